"""Timestamps of a vLLM KV connector's worker-side calls, for bench_vllm_link.py.

``timed(base)`` subclasses a connector class and changes none of its
behaviour: it only notes ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock
for every process of the host, whatever its namespaces) at

- ``bind_connector_metadata`` (a step starts: ``bind``),
- each ``save_kv_layer``, on entry (the layer's KV is computed; ``save``)
  and on return (``save_end``: the time the connector took there is the
  forward's),
- ``wait_for_save`` on entry and on return (``wait_start``, ``wait_end``),
- each request that ``get_transfer_results`` (or ``get_finished``) reports
  loaded (``recv``) or failed to load (``recv_failed``), once its call
  returned,

and appends them as JSON lines (``{"event": ..., "t": ns, ...}``) to the file
named by the environment variable ``BENCH_TIMING_FILE`` (no variable: no
notes). A step's notes are kept in memory and written once, when the step's
results were asked for, so that no write falls inside the forward.

vLLM's ``KVConnectorFactory`` takes ``kv_connector`` by name from the module
named by ``kv_connector_module_path``: this module's ``DatadistAioConnector``
and ``NixlConnector`` are the timed classes, under the same names as the
untimed ones (vLLM checks the name ``NixlConnector`` in its config):

    {"kv_connector": "NixlConnector", "kv_connector_module_path": "vllm_timing", ...}

with this directory on the server's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, TypeVar

ENV = "BENCH_TIMING_FILE"

T = TypeVar("T", bound=type)


def timed(base: T) -> T:
    """A subclass of connector class ``base`` (same name) that notes the times of its worker-side calls."""

    class Timed(base):  # type: ignore[valid-type, misc]
        _timing_path = os.environ.get(ENV)

        def _timing_note(self, event: str, **fields: Any) -> None:
            if self._timing_path:
                notes = self.__dict__.setdefault("_timing_notes", [])
                notes.append({"event": event, "t": time.monotonic_ns(), **fields})

        def _timing_flush(self) -> None:
            notes = self.__dict__.get("_timing_notes")
            if not notes or not self._timing_path:
                return
            text = "".join(json.dumps(note) + "\n" for note in notes)
            notes.clear()
            with open(self._timing_path, "a") as out:
                out.write(text)

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._timing_note("bind")
            super().bind_connector_metadata(connector_metadata)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            self._timing_note("save", layer=layer_name)
            try:
                super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
            finally:
                self._timing_note("save_end")

        def wait_for_save(self) -> None:
            self._timing_note("wait_start")
            try:
                super().wait_for_save()
            finally:
                self._timing_note("wait_end")

        def _timing_results(self, recving: Any, failed: Any) -> None:
            now = time.monotonic_ns()
            if self._timing_path:
                notes = self.__dict__.setdefault("_timing_notes", [])
                notes += [{"event": "recv", "t": now, "request": str(r)} for r in sorted(recving or ())]
                notes += [{"event": "recv_failed", "t": now, "request": str(r)} for r in sorted(failed or ())]
            self._timing_flush()

        # One of these two calls the other in some connectors: only the outer call notes.
        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            outer = not self.__dict__.get("_timing_inside")
            self.__dict__["_timing_inside"] = True
            try:
                results = super().get_transfer_results(finished_req_ids)
            finally:
                if outer:
                    self.__dict__["_timing_inside"] = False
            if outer:
                self._timing_results(results.finished_recving, getattr(results, "failed_recving", ()))
            return results

        def get_finished(self, finished_req_ids: set[str]) -> Any:
            outer = not self.__dict__.get("_timing_inside")
            self.__dict__["_timing_inside"] = True
            try:
                sending, recving = super().get_finished(finished_req_ids)
            finally:
                if outer:
                    self.__dict__["_timing_inside"] = False
            if outer:
                self._timing_results(recving, ())
            return sending, recving

        def shutdown(self) -> None:
            self._timing_flush()
            super().shutdown()

    Timed.__name__ = base.__name__
    Timed.__qualname__ = base.__qualname__
    Timed.__doc__ = base.__doc__
    return Timed  # type: ignore[return-value]


def __getattr__(name: str) -> type:
    """The timed classes, made on first use (NIXL's only where it is asked for)."""
    import importlib

    modules = {"DatadistAioConnector": "datadist_aio.integrations.vllm",
               "NixlConnector": "vllm.distributed.kv_transfer.kv_connector.v1.nixl"}
    if name not in modules:
        raise AttributeError(name)
    made: type = timed(getattr(importlib.import_module(modules[name]), name))
    globals()[name] = made
    return made
