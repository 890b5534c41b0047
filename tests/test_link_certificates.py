"""Link encryption authenticated by certificates (a site's PKI) instead of
keys from the link secret: ``tls_cert_file``, ``tls_key_file`` and
``tls_ca_file``, mutual.

A prompt engine in this process and a decode engine in another, over TCP on
loopback (through a relay where the wire is read). The certificates are
made for each test by the ``openssl`` command: a CA, a certificate it signed
for each end, and a second CA with a certificate of its own that the first
does not vouch for. Checked: two ends whose certificates the CA signed link
without any secret and move every byte, and nothing of the cache crosses
the relay in the clear; a peer whose certificate another CA signed, or that
keys its TLS from the secret, is refused with the reason; and ``init``
refuses a missing, unreadable or mismatched file.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import datadist_aio as dd
from datadist_aio import _native
from support.cache_bytes import tensor_bytes
from support.options import make_options
from support.peer import PeerGroup, cluster_info, raises_status
from support.relay import Relay

SUCCESS = dd.LLMStatusCode.LLM_SUCCESS
LINK_FAILED = dd.LLMStatusCode.LLM_LINK_FAILED
PARAM_INVALID = dd.LLMStatusCode.LLM_PARAM_INVALID
PROMPT, DECODE, MODEL = 1, 2, 7
MARKER = b"\x8dKV-CACHE-MARK\x8e\xa7"
TENSORS, BLOCKS, BLOCK_BYTES = 2, 16, 32 * 1024

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command to make certificates")]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(where: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=where)


def _signed(where: Path, name: str, ca: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=where)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", cwd=where)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    _ca(tmp_path, "site-ca")
    _signed(tmp_path, "prompt", "site-ca")
    _signed(tmp_path, "decode", "site-ca")
    _ca(tmp_path, "other-ca")
    _signed(tmp_path, "stranger", "other-ca")
    return tmp_path


def certs(pki: Path, name: str, ca: str = "site-ca") -> dict[str, object]:
    return {"link_encryption": "tls", "transport": "tcp", "tls_cert_file": str(pki / f"{name}.pem"),
            "tls_key_file": str(pki / f"{name}.key"), "tls_ca_file": str(pki / f"{ca}.pem")}


def desc() -> dd.CacheDesc:
    return dd.CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], dd.DataType.DT_UINT8, dd.Placement.HOST)


@pytest.fixture
def group():
    with PeerGroup() as peers:
        yield peers


@pytest.fixture
def prompt():
    made: list[dd.LLMDataDist] = []

    def make(**options: object) -> dd.LLMDataDist:
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
        datadist.init(make_options(pool_bytes=16 << 20, enable_remote_cache_accessible=True, **options))
        made.append(datadist)
        return datadist

    yield make
    for datadist in made:
        datadist.finalize()


def _decode(group: PeerGroup, options: dict[str, object]):
    decode = group.start("decode", dd.LLMRole.DECODER, DECODE, options=options)
    ref = decode.allocate(desc(), blocks=True, model_id=MODEL)
    return decode, ref, np.stack(decode.fill(ref, seed=5))


def _link(datadist: dd.LLMDataDist, port: int) -> dd.LLMStatusCode:
    status, _ = datadist.link_clusters([cluster_info(DECODE, port)], 10000)
    return status


def _push(datadist: dd.LLMDataDist) -> np.ndarray:
    cache = datadist.cache_manager.allocate_blocks_cache(desc())
    content = np.frombuffer(MARKER * (BLOCKS * BLOCK_BYTES // len(MARKER)), dtype=np.uint8)
    for t in range(TENSORS):
        tensor_bytes(cache, t)[:] = content
    blocks = list(range(BLOCKS))
    datadist.cache_manager.push_blocks(dd.BlocksCacheKey(DECODE, MODEL), cache, blocks, blocks)
    return np.stack([content] * TENSORS)


def test_ends_whose_certificates_the_ca_signed_link_without_a_secret(group, prompt, pki):
    decode, ref, _old = _decode(group, certs(pki, "decode"))
    datadist = prompt(**certs(pki, "prompt"))
    with Relay(decode.listen_port) as relay:
        assert _link(datadist, relay.port) == SUCCESS
        transport = datadist.link_transport(DECODE)
        assert transport == "tcp" and transport.encrypted and transport.cipher == "TLS_AES_128_GCM_SHA256"
        sent = _push(datadist)
        wire = relay.stream_to_acceptor()
    np.testing.assert_array_equal(np.stack(decode.read(ref)), sent)
    assert len(wire) > TENSORS * BLOCKS * BLOCK_BYTES and MARKER[:8] not in wire, "the cache crossed in the clear"


@pytest.mark.parametrize("who", ["prompt", "decode"])
def test_a_certificate_another_ca_signed_is_refused(group, prompt, pki, who):
    """Either end presenting a certificate the other's CA did not sign fails
    the link, with the certificate's reason, and moves nothing."""
    decode_options = certs(pki, "stranger", "site-ca") if who == "decode" else certs(pki, "decode")
    decode, ref, old = _decode(group, decode_options)
    datadist = prompt(**(certs(pki, "stranger", "site-ca") if who == "prompt" else certs(pki, "prompt")))
    assert _link(datadist, decode.listen_port) == LINK_FAILED
    message = _native.last_error_message()
    # The initiator says why: the decode's certificate did not verify here,
    # or the decode refused the prompt's (its alert, in place of its
    # confirmation of the prompt's certificate).
    assert "TLS handshake" in message and ("certificate" in message or "unknown ca" in message), message
    with raises_status(dd.LLMStatusCode.LLM_NOT_YET_LINK):
        datadist.link_transport(DECODE)
    np.testing.assert_array_equal(np.stack(decode.read(ref)), old)


def test_certificates_on_one_end_and_the_secret_on_the_other_are_refused_naming_both(group, prompt, pki):
    decode, _ref, _old = _decode(group, {"auth_key": "a secret", "link_encryption": "tls", "transport": "tcp"})
    datadist = prompt(**certs(pki, "prompt"), auth_key="a secret")
    assert _link(datadist, decode.listen_port) == LINK_FAILED
    message = _native.last_error_message()
    assert f'"tls" with certificates on this end, cluster {PROMPT}; "tls" on cluster {DECODE}' in message, message


def test_init_refuses_certificates_it_cannot_use(pki):
    def refused(**options: object) -> str:
        datadist = dd.LLMDataDist(dd.LLMRole.PROMPT, PROMPT)
        with raises_status(PARAM_INVALID) as info:
            datadist.init(make_options(**options))
        datadist.finalize()
        return str(info.value)

    good = certs(pki, "prompt")
    assert "tls_key_file" in refused(**{k: v for k, v in good.items() if k != "tls_key_file"})
    assert "encryption is off" in refused(**{**good, "link_encryption": "off"})
    assert "missing.pem" in refused(**{**good, "tls_cert_file": str(pki / "missing.pem")})
    assert "is not the key" in refused(**{**good, "tls_key_file": str(pki / "decode.key")})
    assert "other.key" in refused(**{**good, "tls_ca_file": str(pki / "other-ca.key")}) or \
        "CA file" in refused(**{**good, "tls_ca_file": str(pki / "other-ca.key")})
    assert "secret" in refused(link_encryption="tls", transport="tcp")
    with pytest.raises(dd.LLMException):
        dd.LLMConfig().tls_cert_file = ""
