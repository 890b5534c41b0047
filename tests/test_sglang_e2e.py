"""Real SGLang servers with the datadist_aio transfer backend (``pytest -m sglang``).

One module-wide set of servers on loopback, started together: a server with
no disaggregation (the reference), a prefill server and a decode server
with ``--disaggregation-transfer-backend datadist_aio``, and sglang-router
in ``--pd-disaggregation`` mode in front of the pair; and for differing
attention TP sizes a prefill and a decode server of TP 2, each paired by a
router of its own with the TP 1 server of the other role (prefill TP 2 into
decode TP 1, prefill TP 1 into decode TP 2); and a prefill of two pipeline
stages with a router of its own into the decode of one. The tiny random Llama of the
vLLM tests (2 KV heads: one per rank at TP 2), token ids in and out,
greedy. The pairs use pages of 16 tokens and prefill chunks of 64 (a
request's KV moves in several pulls); the reference, TP 1 and pages of one
token.

The tests run in file order: the failure tests last, since they freeze,
kill and restart the prefill server.

Needs SGLang's CPU environment (``.ci/run`` builds it in build/venv-sglang).
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

from sglang_pd import (  # noqa: E402
    Router,
    Server,
    assert_decode_follows_handed_kv,
    assert_no_leak_reported,
    assert_stages_token_exact,
    finish_message,
    free_port_run,
    generate,
    generate_outcome,
    model_dir,
    stop_all,
    tp_env,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

NEW_TOKENS = 12
LENGTHS = [3, 17, 64, 65, 200, 511]
PAGE_SIZE = 16
TLS_ENV = {"DATADIST_AIO_AUTH_KEY": "the sglang e2e link secret", "DATADIST_AIO_LINK_ENCRYPTION": "tls"}
# The decode's deadlines, short for the failure tests: the engine's per-pull
# timeout, and SGLang's heartbeat to the prefill (interval, misses).
DECODE_ENV = {
    "DATADIST_AIO_SGLANG_TIMEOUT_S": "5",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}
FAILED_WITHIN_S = 30.0
NCCL_PORTS = 9  # eight servers, and a prefill started again
# An idle scheduler of TP 2 on the CPU spins (its ranks exchange every loop
# through gloo: about 1.4 cores a server); it sleeps on its socket instead,
# up to a second a step while it waits for a transfer.
TP2_EXTRA = ["--sleep-on-idle"]


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(length)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sglang")
    model = model_dir(root)
    # base .. base + 24: the servers' and routers' ports; from base + 25: each
    # server's rendezvous port, the last for a restarted prefill.
    base = free_port_run(25 + NCCL_PORTS)
    nccl = iter(range(base + 25, base + 25 + NCCL_PORTS - 1))
    started: list[Any] = []
    try:
        reference = Server(model, "null", base, root, nccl_port=next(nccl))
        started.append(reference)
        prefill = _prefill(model, base, root, next(nccl))
        started.append(prefill)
        decode = Server(model, "decode", base + 3, root, nccl_port=next(nccl), page_size=PAGE_SIZE, env=DECODE_ENV)
        started.append(decode)
        prefill_tp2 = _prefill(model, base + 4, root, next(nccl), tp_size=2)
        started.append(prefill_tp2)
        decode_tp2 = Server(model, "decode", base + 7, root, nccl_port=next(nccl), page_size=PAGE_SIZE, tp_size=2,
                            env=DECODE_ENV, extra=TP2_EXTRA)
        started.append(decode_tp2)
        # Two pipeline stages: each only its own layers' KV buffers.
        prefill_pp2 = Server(model, "prefill", base + 14, root, nccl_port=next(nccl), bootstrap_port=base + 15,
                             page_size=PAGE_SIZE,
                             extra=["--chunked-prefill-size", "64", "--pp-size", "2", *TP2_EXTRA], env=tp_env(2))
        started.append(prefill_pp2)
        # A pair with a link secret and link encryption: links, the backend's messages and the
        # KV in TLS.
        prefill_tls = Server(model, "prefill", base + 20, root, nccl_port=next(nccl), bootstrap_port=base + 21,
                             page_size=PAGE_SIZE, extra=["--chunked-prefill-size", "64"], env=TLS_ENV)
        started.append(prefill_tls)
        decode_tls = Server(model, "decode", base + 22, root, nccl_port=next(nccl), page_size=PAGE_SIZE,
                            env={**DECODE_ENV, **TLS_ENV})
        started.append(decode_tls)
        deadline = time.monotonic() + 600
        for server in (prefill, decode, reference, prefill_tp2, decode_tp2, prefill_pp2, prefill_tls, decode_tls):
            server.ready(deadline)
        routers = {"router": Router(prefill, decode, base + 8, root, base + 11),
                   "tp2-into-tp1": Router(prefill_tp2, decode, base + 9, root, base + 12),
                   "tp1-into-tp2": Router(prefill, decode_tp2, base + 10, root, base + 13),
                   "pp2-into-pp1": Router(prefill_pp2, decode, base + 16, root, base + 17),
                   "pp2-into-tp2": Router(prefill_pp2, decode_tp2, base + 18, root, base + 19),
                   "tls": Router(prefill_tls, decode_tls, base + 23, root, base + 24)}
        started += routers.values()
        for router in routers.values():
            router.ready(time.monotonic() + 300)
        yield {"reference": reference, "prefill": prefill, "decode": decode, "prefill_tp2": prefill_tp2,
               "decode_tp2": decode_tp2, "prefill_pp2": prefill_pp2, "prefill_tls": prefill_tls,
               "decode_tls": decode_tls, **routers, "root": root, "model": model, "base": base, "started": started}
    finally:
        stop_all(list(reversed(started)))


def _prefill(model: Path, base: int, root: Path, nccl_port: int, tp_size: int = 1) -> Server:
    return Server(model, "prefill", base + 1, root, nccl_port=nccl_port, bootstrap_port=base + 2,
                  page_size=PAGE_SIZE, tp_size=tp_size,
                  extra=["--chunked-prefill-size", "64"] + (TP2_EXTRA if tp_size > 1 else []))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(33)
    return [_prompt(rng, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def references(servers: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    return [generate(servers["reference"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]


def test_router_outputs_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                    references: list[list[int]]) -> None:
    """Every prompt through the router and the disaggregated pair: the single server's tokens."""
    outputs = [generate(servers["router"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]
    for length, got, want in zip(LENGTHS, outputs, references):
        assert len(want) == NEW_TOKENS
        assert got == want, f"prompt of {length} tokens: {got} != {want}"
    # The decode server's transfers went through this backend and linked to the prefill.
    log = Path(servers["decode"].log_path).read_text(errors="replace")
    assert "datadist_aio: linked to the prefill" in log


def test_concurrent_requests_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                         references: list[list[int]]) -> None:
    """The same prompts all at once: batches on both servers, pulls in flight together."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: generate(servers["router"].url, p, NEW_TOKENS)["output_ids"], prompts))
    assert outputs == references


def test_control_decode_follows_the_kv_it_was_handed(servers: dict[str, Any]) -> None:
    """A decode handed another prompt's KV continues that prompt, not its own: the bytes moved."""
    assert_decode_follows_handed_kv(servers["reference"], servers["prefill"], servers["decode"], 7, NEW_TOKENS)


# Differing attention TP sizes: the router of each pair, its prefill and decode server.
TP_PAIRS = {"tp2-into-tp1": ("prefill_tp2", "decode"), "tp1-into-tp2": ("prefill", "decode_tp2")}


@pytest.mark.parametrize("pair", list(TP_PAIRS))
def test_differing_tp_sizes_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                        references: list[list[int]], pair: str) -> None:
    """Prefill TP 2 into decode TP 1 (each prefill rank gives its head of every token) and TP 1
    into TP 2 (each decode rank reads its head): every prompt through the pair's router, one at a
    time, the single server's tokens."""
    outputs = [generate(servers[pair].url, p, NEW_TOKENS)["output_ids"] for p in prompts]
    for length, got, want in zip(LENGTHS, outputs, references):
        assert got == want, f"{pair}, prompt of {length} tokens: {got} != {want}"
    log = Path(servers[TP_PAIRS[pair][1]].log_path).read_text(errors="replace")
    linked = [line for line in log.splitlines() if "datadist_aio: linked to the prefill" in line]
    wanted = ["(TP 0/2,", "(TP 1/2,"] if pair == "tp2-into-tp1" else ["(TP 0/1,"]
    assert all(any(rank in line for line in linked) for rank in wanted), linked


def test_differing_tp_sizes_concurrent_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                                   references: list[list[int]]) -> None:
    """Every prompt through both pairs' routers at once: the TP 1 decode pulls from the TP 2
    prefill while the TP 1 prefill serves the TP 2 decode."""
    import concurrent.futures

    jobs = [(pair, p) for pair in TP_PAIRS for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(pool.map(lambda job: generate(servers[job[0]].url, job[1], NEW_TOKENS)["output_ids"], jobs))
    assert outputs == references * len(TP_PAIRS)


@pytest.mark.parametrize("pair", list(TP_PAIRS))
def test_differing_tp_sizes_control(servers: dict[str, Any], pair: str) -> None:
    """A decode handed another prompt's KV across differing TP sizes continues that prompt."""
    prefill, decode = (servers[name] for name in TP_PAIRS[pair])
    assert_decode_follows_handed_kv(servers["reference"], prefill, decode, 11, NEW_TOKENS)


@pytest.mark.parametrize("pair, decode", [("pp2-into-pp1", "decode"), ("pp2-into-tp2", "decode_tp2")])
def test_a_prefill_of_two_pipeline_stages_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                                      pair: str, decode: str) -> None:
    """A prefill of two pipeline stages (stage 0 layers 0 and 1, stage 1 layers 2 and 3, each
    only its own layers' buffers) into the decode of one stage: each stage's layers land at
    their offset among the decode's, and a request completes once both stages sent their last
    chunk; into a decode of TP 2, each decode rank reads its head of each stage's layers."""
    assert_stages_token_exact(servers["reference"], servers[pair], servers["prefill_pp2"], servers[decode],
                              prompts, NEW_TOKENS)


def test_with_link_encryption_token_exact(servers: dict[str, Any], prompts: list[list[int]],
                                          references: list[list[int]]) -> None:
    """A pair with a link secret and link encryption (DATADIST_AIO_AUTH_KEY and
    DATADIST_AIO_LINK_ENCRYPTION=tls on both): the backend's messages sealed and encrypted,
    the links in TLS; every output exact, and the control."""
    outputs = [generate(servers["tls"].url, p, NEW_TOKENS)["output_ids"] for p in prompts]
    assert outputs == references
    log = Path(servers["decode_tls"].log_path).read_text(errors="replace")
    assert "datadist_aio: linked to the prefill" in log and "links are not authenticated" not in log
    assert_decode_follows_handed_kv(servers["reference"], servers["prefill_tls"], servers["decode_tls"], 17,
                                    NEW_TOKENS)


def _long_request_then(servers: dict[str, Any], action: Any, seed: int,
                       prefill_name: str = "prefill") -> tuple[int, dict[str, Any], float]:
    """A long prompt (many prefill chunks, each pulled as it is computed) sent by hand to the
    prefill ``prefill_name`` and the decode; ``action`` runs on the prefill while it computes.
    The decode's answer and its time."""
    import threading

    prefill = servers[prefill_name]
    rng = random.Random(seed)
    prompt = _prompt(rng, 3000)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": rng.randrange(1 << 62)}

    def prefill_side() -> None:
        try:  # its answer does not matter: the prefill is frozen or killed under it
            generate_outcome(prefill.url, prompt, NEW_TOKENS, 60.0, **boot)
        except OSError:
            pass

    log = Path(prefill.log_path)
    seen = _prefill_batches(log)
    stop = threading.Event()

    def act_mid_request() -> None:  # once the prefill has computed (and sent) some chunks, not all
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            if _prefill_batches(log) >= seen + CHUNKS_BEFORE_ACTION:
                action()
                return
            time.sleep(0.02)

    threading.Thread(target=prefill_side, daemon=True).start()
    start = time.monotonic()
    actor = threading.Thread(target=act_mid_request, daemon=True)
    actor.start()
    try:
        status, body = generate_outcome(servers["decode"].url, prompt, NEW_TOKENS, FAILED_WITHIN_S + 30, **boot)
    finally:
        stop.set()
        actor.join(5)
    return status, body, time.monotonic() - start


# The failure tests act on the prefill after it has computed this many chunks
# of the long prompt's 47 (each pulled by the decode as it comes).
CHUNKS_BEFORE_ACTION = 3


def _prefill_batches(log: Path) -> int:
    """How many prefill batches (chunks) the prefill server has logged."""
    return log.read_text(errors="replace").count("Prefill batch")


def test_frozen_prefill_fails_the_request_in_time_and_frees_its_pages(servers: dict[str, Any],
                                                                      references: list[list[int]],
                                                                      prompts: list[list[int]]) -> None:
    """SIGSTOP on the prefill mid-request: the decode reports the request failed, with the reason,
    within the deadlines; once the prefill runs again both sides have freed it and serve exactly."""
    prefill = servers["prefill"]
    try:
        status, body, took = _long_request_then(servers, lambda: prefill.signal(signal.SIGSTOP), 99)
    finally:
        prefill.signal(signal.SIGCONT)
    message = finish_message(body)
    print(f"frozen prefill: HTTP {status} after {took:.1f} s: {message[:300]}")
    assert took < FAILED_WITHIN_S
    assert "Lost connection with prefill" in message or "LLM_TIMEOUT" in message, message
    time.sleep(8)  # the prefill catches up: its late chunks are refused, its pages freed
    outputs = [generate(servers["router"].url, p, NEW_TOKENS)["output_ids"] for p in prompts[:3]]
    assert outputs == references[:3]
    assert_no_leak_reported(servers["decode"])
    assert_no_leak_reported(prefill)


def test_killed_prefill_fails_the_request_then_a_restarted_one_relinks(servers: dict[str, Any],
                                                                       references: list[list[int]],
                                                                       prompts: list[list[int]]) -> None:
    """SIGKILL on the prefill mid-request: the decode fails the request at its next poll, from
    the link that dropped (its pull failed, or the link is gone before the next chunk), not
    SGLang's heartbeat seconds later; a new prefill server on the same ports serves the same
    decode (a new link) token-exact."""
    old = servers["prefill"]
    status, body, took = _long_request_then(servers, lambda: old.signal(signal.SIGKILL), 100)
    message = finish_message(body)
    print(f"killed prefill: HTTP {status} after {took:.1f} s: {message[:300]}")
    assert took < FAILED_WITHIN_S
    # Its pull failed (LLM_LINK_FAILED), or an earlier one already dropped the link (LLM_NOT_YET_LINK).
    assert ("LLM_LINK_FAILED" in message or "LLM_NOT_YET_LINK" in message) and \
        "Lost connection with prefill" not in message, message
    old.stop()
    new = _prefill(servers["model"], servers["base"], servers["root"],
                   servers["base"] + 25 + NCCL_PORTS - 1)
    servers["started"].append(new)
    servers["prefill"] = new
    new.ready(time.monotonic() + 400)
    decode_log = Path(servers["decode"].log_path)
    links = decode_log.read_text(errors="replace").count("datadist_aio: linked to the prefill")
    deadline = time.monotonic() + 120
    while True:  # the router finds the prefill back once its health check passes
        status, body = generate_outcome(servers["router"].url, prompts[4], NEW_TOKENS)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert status == 200, body
    assert body["output_ids"] == references[4]
    assert decode_log.read_text(errors="replace").count("datadist_aio: linked to the prefill") == links + 1
    assert_no_leak_reported(servers["decode"])


def _stage_process(server: Server, stage: int) -> int:
    """The pid of a pipeline stage's scheduler process of ``server`` (SGLang titles it
    ``sglang::scheduler_..._PP<stage>``)."""
    import psutil

    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if title.startswith("sglang::scheduler") and title.rstrip().endswith(f"PP{stage}"):
            return int(child.pid)
    raise AssertionError(f"no scheduler process of stage {stage} under {server.log_path.name}")


def test_a_stage_that_dies_mid_request_fails_it_in_time_and_frees_its_pages(
        servers: dict[str, Any], references: list[list[int]], prompts: list[list[int]]) -> None:
    """SIGKILL on the second stage of the two-stage prefill mid-request: the decode, waiting for
    both stages' chunks, fails the request within the deadlines (a dropped link, or SGLang's
    word that the prefill is gone), frees its pages, and serves other prefills exactly after."""
    import os

    stage = _stage_process(servers["prefill_pp2"], 1)
    status, body, took = _long_request_then(servers, lambda: os.kill(stage, signal.SIGKILL), 101, "prefill_pp2")
    message = finish_message(body)
    print(f"killed stage: HTTP {status} after {took:.1f} s: {message[:300]}")
    assert status != 200 and took < FAILED_WITHIN_S, message
    # The rest of the server goes too: the request sent to it by hand ends (its socket closes).
    servers["prefill_pp2"].stop()
    time.sleep(2)
    outputs = [generate(servers["router"].url, p, NEW_TOKENS)["output_ids"] for p in prompts[:3]]
    assert outputs == references[:3]
    assert_no_leak_reported(servers["decode"])
