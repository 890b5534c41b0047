"""The transport's structure, as its sources say it: every way bytes move is
a path of its own folder under ``native/src/transport/paths/``, inline on
the connections among them, and the control plane (the link, the link
manager, the listener, the wire and the handshake) names none of them. A
path's classes, namespaces and headers are found in its folder, so a new
path is checked as it lands.
"""

from __future__ import annotations

import re
from pathlib import Path

TRANSPORT = Path(__file__).resolve().parent.parent / "native" / "src" / "transport"
PATHS = TRANSPORT / "paths"
CONTROL_PLANE = ("link*.cpp", "link*.h", "wire.h", "wire.cpp", "handshake.h", "handshake.cpp", "listener.h",
                 "listener.cpp")


def _code(text: str) -> str:
    """The text without its comments and string literals (words there may name anything)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def _folders() -> list[Path]:
    return sorted(p for p in PATHS.iterdir() if p.is_dir())


def _declared(headers) -> set[str]:
    """The classes, structs and namespaces the headers declare."""
    names: set[str] = set()
    for header in headers:
        code = _code(header.read_text())
        names.update(re.findall(r"\b(?:class|struct)\s+([A-Z]\w+)\s*(?:final\s*)?[:{]", code))
        names.update(re.findall(r"\busing\s+([A-Z]\w+)\s*=", code))
        for spec in re.findall(r"\bnamespace\s+([\w:]+)\s*\{", code):
            names.update(spec.split("::"))
    return names


def _names(folder: Path) -> set[str]:
    """The names a path's folder declares and nothing outside the paths does
    (a namespace it only adds forward declarations to is not its own)."""
    outside = _declared(h for h in (TRANSPORT.parent).rglob("*.h") if PATHS not in h.parents)
    return _declared(folder.glob("*.h")) - outside


def test_every_path_is_a_folder_with_its_own_names():
    folders = {f.name for f in _folders()}
    assert {"inline", "same_host", "device", "ucx", "test"} <= folders, folders
    for folder in _folders():
        assert _names(folder), f"{folder.name}/ declares no class of its own"


def test_the_control_plane_names_no_path():
    files = sorted({f for pattern in CONTROL_PLANE for f in TRANSPORT.glob(pattern)})
    assert any(f.name == "link.cpp" for f in files) and any(f.name == "link_manager.cpp" for f in files), files
    named = {}
    for folder in _folders():
        for name in _names(folder):
            named[name] = folder.name
    seen = []
    for source in files:
        code = _code(source.read_text())
        # Includes are string literals: read them from the text itself.
        for include in re.findall(r'#include\s+"transport/paths/([^"/]+)/', source.read_text()):
            seen.append(f"{source.name} includes a header of paths/{include}/")
        for word in set(re.findall(r"\b[A-Za-z_]\w*\b", code)):
            if word in named:
                seen.append(f"{source.name} names {word} (paths/{named[word]}/)")
    assert not seen, seen


def test_each_folder_is_reached_from_paths_cpp_alone():
    paths_cpp = (PATHS / "paths.cpp").read_text()
    for folder in _folders():
        assert f'#include "transport/paths/{folder.name}/' in paths_cpp, folder.name
    # Outside the paths, only the engine's transport may make the kinds (paths.h); no other
    # transport file includes a path's header.
    for source in TRANSPORT.glob("*.[ch]*"):
        included = re.findall(r'#include\s+"transport/paths/([^"/]+)/', source.read_text())
        assert not included, (source.name, included)
