"""The plugin against the installed SGLang (run in SGLang's environment; skipped elsewhere)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from sglang_pd import CPU_ENV

if importlib.util.find_spec("sglang") is None:
    pytest.skip("could not import 'sglang': SGLang's environment only", allow_module_level=True)
for _name, _value in CPU_ENV.items():  # SGLang's CPU path, as the servers run it
    os.environ.setdefault(_name, _value)
sys.path.insert(0, CPU_ENV["PYTHONPATH"])

from sglang.srt.disaggregation.utils import KVClassType, TransferBackend  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from datadist_aio.integrations.sglang import plugin  # noqa: E402


@pytest.fixture(scope="module")
def registered() -> None:
    plugin.register()
    plugin.register()  # a process that loads plugins twice registers once
    HookRegistry.apply_hooks()


def test_backend_is_a_member_and_a_choice(registered: None) -> None:
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    member = TransferBackend("datadist_aio")
    assert member is TransferBackend["DATADIST_AIO"] and member.value == "datadist_aio"
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("datadist_aio") == 1
    assert TransferBackend("mooncake") is TransferBackend.MOONCAKE


def test_get_kv_class_answers_ours_and_leaves_the_others(registered: None) -> None:
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.fake import FakeKVManager

    from datadist_aio.integrations.sglang import conn

    member = TransferBackend("datadist_aio")
    assert utils.get_kv_class(member, KVClassType.MANAGER) is conn.DatadistAioKVManager
    assert utils.get_kv_class(member, KVClassType.SENDER) is conn.DatadistAioKVSender
    assert utils.get_kv_class(member, KVClassType.RECEIVER) is conn.DatadistAioKVReceiver
    assert utils.get_kv_class(member, KVClassType.BOOTSTRAP_SERVER) is conn.DatadistAioKVBootstrapServer
    assert utils.get_kv_class(member, KVClassType.KVARGS).__name__ == "KVArgs"
    assert utils.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager
    # The modules that imported get_kv_class by name see the hook too.
    from sglang.srt.disaggregation import decode, prefill

    assert prefill.get_kv_class is utils.get_kv_class and decode.get_kv_class is utils.get_kv_class


def test_entry_point_makes_the_flag_parse_in_a_fresh_process() -> None:
    """SGLang's own loading: the installed entry point, then its argument parser."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "import argparse; from sglang.srt.server_args import ServerArgs;"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p);"
        "a = p.parse_args(['--model-path', 'x', '--disaggregation-transfer-backend', 'datadist_aio']);"
        "print(a.disaggregation_transfer_backend)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "datadist_aio"


def test_state_buffers_of_a_hybrid_swa_model_are_taken_and_others_refused_by_name() -> None:
    """The manager's reading of ``KVArgs``' state buffers: a hybrid SWA model's window pool is
    taken (its addresses, lengths and item lengths), none is none, any other state type is
    refused with its name before anything is registered."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import StateType

    from datadist_aio.integrations.sglang.conn import _swa_indices, _swa_state

    def args(types: list, pointers: list) -> SimpleNamespace:
        return SimpleNamespace(state_types=types, state_data_ptrs=pointers,
                               state_data_lens=[[4096] * len(p) for p in pointers],
                               state_item_lens=[[256] * len(p) for p in pointers])

    assert _swa_state(args([], [])) is None
    assert _swa_state(args([StateType.SWA], [[0x1000, 0x2000]])) == ([0x1000, 0x2000], [4096, 4096], [256, 256])
    for refused in (StateType.MAMBA, StateType.DSA):
        with pytest.raises(NotImplementedError, match=refused.value):
            _swa_state(args([StateType.SWA, refused], [[0x1000], [0x3000]]))
    assert _swa_indices(None) is None and _swa_indices([None]) is None
    assert _swa_indices([[3, 4]]).tolist() == [3, 4]
