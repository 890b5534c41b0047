// The UCX plugin (transport/paths/ucx/ucx_plugin.h), loaded at run time: the
// first use opens libdatadist_ucx.so from beside the engine's own library
// (or the file named by $DATADIST_AIO_UCX_PLUGIN) with dlopen, after UCX
// itself: the folder named by $DATADIST_AIO_UCX_LIB_DIR where it is set,
// else a system libucp.so.0 on the loader's paths, then the libucx-cu12
// wheel's libraries (site-packages/libucx/lib beside the engine's package).
// The plugin is built against the system's UCX headers, else the wheel's
// (pip builds bring it); without UCX the reason says what is missing.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_LOADER_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_LOADER_H_

#include <string>

#include "transport/paths/ucx/ucx_plugin.h"

namespace datadist::ucx {

constexpr const char kPluginEnv[] = "DATADIST_AIO_UCX_PLUGIN";
constexpr const char kLibDirEnv[] = "DATADIST_AIO_UCX_LIB_DIR";
constexpr const char kPluginFile[] = "libdatadist_ucx.so";

struct Plugin {
  const datadist_ucx_plugin_v1 *api = nullptr;
  std::string path;          // the plugin file
  std::string ucx_from;      // "the system's libucp.so.0" or the wheel's folder
  std::string version;       // UCX's own, "1.13.1"

  // "Connection reset by remote peer (UCX status -25)".
  std::string describe(int status) const;
};

// The loaded plugin, or null with why there is none ("UCX not found: ...").
// The first call decides for the life of the process.
const Plugin *load_plugin(std::string &why);

}  // namespace datadist::ucx

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_LOADER_H_
