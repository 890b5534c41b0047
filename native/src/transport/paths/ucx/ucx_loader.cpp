#include "transport/paths/ucx/ucx_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>

namespace datadist::ucx {

namespace {

struct Loaded {
  Plugin plugin;
  std::string why;  // set when there is no plugin
};

std::string dl_error() {
  const char *error = dlerror();
  return error != nullptr ? error : "unknown error";
}

std::string env(const char *name) {
  const char *value = std::getenv(name);
  return value != nullptr ? value : "";
}

// The folder of the library this code is linked into (the Python
// extension or libllm_datadist.so).
std::string own_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void *>(&load_plugin), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool exists(const std::string &path) { return access(path.c_str(), R_OK) == 0; }

// Loads UCX's libraries from `folder`, in the order they need each other.
std::string load_folder(const std::string &folder) {
  for (const char *name : {"libucm.so.0", "libucs.so.0", "libuct.so.0", "libucp.so.0"}) {
    std::string path = folder + "/" + name;
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr && std::string(name) != "libucm.so.0") {
      return "UCX not found: " + path + " could not be loaded (" + dl_error() + ")";
    }
  }
  return "";
}

// UCX's libraries in the process, so that the plugin's libucp.so.0 resolves;
// they stay loaded for its life. A folder named in the environment is taken
// alone; else the system's UCX, then the wheel's. Empty on success, else why
// not.
std::string load_ucx(const std::string &own, std::string &from) {
  std::string named = env(kLibDirEnv);
  if (!named.empty()) {
    if (!exists(named + "/libucp.so.0")) {
      return "UCX not found: $" + std::string(kLibDirEnv) + " names " + named + ", which has no libucp.so.0";
    }
    from = named;
    return load_folder(named);
  }
  if (dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL) != nullptr) {
    from = "the system's libucp.so.0";
    return "";
  }
  std::string system_error = dl_error();
  std::string wheel = own + "/../libucx/lib";  // the libucx-cu12 wheel in the same site-packages
  if (!exists(wheel + "/libucp.so.0")) {
    return "UCX not found: libucp.so.0 could not be loaded (" + system_error + ") and there is no libucx-cu12 "
           "wheel at " + wheel + "; install UCX (Debian: apt-get install libucx0), or the wheel "
           "(pip install 'datadist_aio[ucx]'), or name UCX's library folder in $" + kLibDirEnv;
  }
  from = wheel;
  return load_folder(wheel);
}

Loaded load() {
  Loaded out;
  Plugin &p = out.plugin;
  std::string own = own_folder();
  p.path = env(kPluginEnv);
  if (p.path.empty()) p.path = own + "/" + kPluginFile;
  if (!exists(p.path)) {
    out.why = "UCX not found: there is no UCX plugin at " + p.path +
              " (datadist_aio builds it only where UCX's headers are found: build again with pip, which brings the "
              "libucx-cu12 wheel's, or install libucx-dev first)";
    return out;
  }
  out.why = load_ucx(own, p.ucx_from);
  if (!out.why.empty()) return out;
  void *library = dlopen(p.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    out.why = "UCX not found: the UCX plugin " + p.path + " could not be loaded (" + dl_error() + ")";
    return out;
  }
  auto entry = reinterpret_cast<datadist_ucx_entry_fn>(dlsym(library, DATADIST_UCX_ENTRY_SYMBOL));
  const datadist_ucx_plugin_v1 *api = entry != nullptr ? entry() : nullptr;
  if (api == nullptr) {
    out.why = "the UCX plugin " + p.path + " has no " + DATADIST_UCX_ENTRY_SYMBOL;
    return out;
  }
  if (api->abi_version != DATADIST_UCX_ABI_VERSION || api->struct_size < sizeof(datadist_ucx_plugin_v1)) {
    out.why = "the UCX plugin " + p.path + " has ABI version " + std::to_string(api->abi_version) +
              " (table of " + std::to_string(api->struct_size) + " bytes); this engine needs version " +
              std::to_string(DATADIST_UCX_ABI_VERSION) + ": install the plugin built with it";
    return out;
  }
  p.api = api;
  p.version = api->ucx_version();
  return out;
}

}  // namespace

std::string Plugin::describe(int status) const {
  const char *text = api != nullptr ? api->status_string(status) : nullptr;
  return std::string(text != nullptr ? text : "unknown") + " (UCX status " + std::to_string(status) + ")";
}

const Plugin *load_plugin(std::string &why) {
  static const Loaded loaded = load();
  why = loaded.why;
  return loaded.why.empty() ? &loaded.plugin : nullptr;
}

}  // namespace datadist::ucx
