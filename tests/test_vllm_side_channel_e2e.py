"""A prefill vLLM and a decode vLLM sharing a link secret, and a forger who does not know it.

One pair of engines (``DATADIST_AIO_AUTH_KEY`` set in both), with link
encryption off and on (``DATADIST_AIO_LINK_ENCRYPTION``): their links and
their side channel prove the secret. Between the prefill's answer and the
decode's read, this process (a third one) sends the prefill's side channel
a ``done`` for the request, plain and sealed under a guessed secret, and a
lease claim; the prefill then takes another step, where a done it had
taken would free the request's blocks. The decode's output must be the
transferred KV's (the KV-swap control: prompt A's tokens with prompt B's
KV answer as B), with no failed transfer. Marked ``vllm``.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm")

from datadist_aio.integrations.message_guard import MessageGuard  # noqa: E402
from datadist_aio.integrations.vllm.side_channel import encode_body, encode_frame, frame  # noqa: E402
from test_vllm_e2e import FAILED, MAX_TOKENS, XFERS, prefill_params, started, tokens  # noqa: E402
from vllm_pd import Engine, connector_config, delta, free_port_run, model_dir, prompts_of_lengths  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SECRET = secrets.token_hex(32)


@pytest.fixture(scope="module", params=["off", "tls"])
def secret_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The pair with a link secret; ``tls``: link encryption on too (the
    links' TCP connections and the side channel encrypted)."""
    model = model_dir(tmp_path_factory.mktemp("vllm-model"))
    env = {"DATADIST_AIO_AUTH_KEY": SECRET, "DATADIST_AIO_LINK_ENCRYPTION": request.param}
    yield from started(
        ("prefill", lambda: Engine(model, connector_config("datadist", "kv_producer", free_port_run(1)), env=env)),
        ("decode", lambda: Engine(model, connector_config("datadist", "kv_consumer", 0, load_timeout_s=5.0),
                                  policy="recompute", env=env)),
    )


def _forge(host: str, port: int, messages: list[bytes]) -> list[bytes]:
    """Each message on a connection of its own; what came back for each."""
    answers = []
    for data in messages:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            answers.append(received)
    return answers


def test_a_forged_done_before_the_decode_reads_frees_nothing(secret_pair: dict[str, Any]) -> None:
    prefill, decode = secret_pair["prefill"], secret_pair["decode"]
    a, b, other = prompts_of_lengths([300, 300, 200], seed=5)
    a[-1] = b[-1]  # the decode recomputes the last token itself: the same for both
    ref_a, ref_b = tokens(prefill.generate([a, b], MAX_TOKENS))
    assert ref_a != ref_b
    (params_b,) = prefill_params(prefill, [b])
    host, port, req_id = params_b["remote_host"], int(params_b["remote_port"]), params_b["remote_request_id"]
    forged = [
        {"op": "done", "req_ids": [req_id], "readers": 1},
        {"op": "hold", "requests": {req_id: "guessed"}, "engine_id": params_b["remote_engine_id"], "hold_s": 1},
    ]
    guessed = MessageGuard("a guessed secret")
    sends = [encode_frame(m) for m in forged] + [frame(guessed.seal_request(encode_body(m), port)[0]) for m in forged]
    answers = _forge(host, port, sends)
    # A step of the prefill: a done it had taken would free the request's blocks here.
    prefill.generate([other], 1)
    before = decode.metrics()
    (got,) = tokens(decode.generate([a], MAX_TOKENS, [params_b]))
    after = decode.metrics()
    assert delta(after, before, FAILED) == 0, "the decode's read failed: the prefill had freed the blocks"
    assert delta(after, before, XFERS) == 1
    assert got == ref_b, "the decode did not follow the transferred KV"
    assert got != ref_a
    assert answers == [b""] * len(sends), "a forged message got an answer"
