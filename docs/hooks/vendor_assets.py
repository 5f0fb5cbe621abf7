"""Serve MathJax and mermaid from the site itself, so that the book works with no network.

The two libraries come from their npm packages, pinned by version and checked against the registry's
sha512 integrity hash. They are unpacked once into ``.cache/web/`` (ignored by git) and added to the
site under ``vendor/`` at build time; ``mkdocs.yml`` loads them from there through ``extra_javascript``.
Material's mermaid integration uses a global ``mermaid`` when one is defined, so it never reaches for
its CDN copy.

    python docs/hooks/vendor_assets.py     fetch now (scripts/setup.sh dev does this; idempotent)

A build with an empty cache fetches them too, so ``mkdocs build`` works on a fresh clone with network.
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "web"
SITE_PREFIX = "vendor"

# name -> (version, npm integrity, member prefix in the tarball, members to leave out)
PACKAGES = {
    "mathjax": (
        "3.2.2",
        "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
        "package/es5/",
        # other combined builds of the same library; the site loads tex-mml-chtml.js, which pulls its
        # fonts (output/chtml/fonts), TeX extensions and menu parts from beside itself on demand
        ("tex-chtml.js", "tex-chtml-full.js", "tex-chtml-full-speech.js", "tex-svg.js", "tex-svg-full.js",
         "tex-mml-svg.js", "mml-chtml.js", "mml-svg.js", "node-main.js", "latest.js"),
    ),
    "mermaid": (
        "11.12.2",
        "sha512-n34QPDPEKmaeCG4WDMGy0OT6PSyxKCfy2pJgShP+Qow2KLrvWjclwbc3yXfSIf4BanqWEhQEpngWwNp/XhZt6w==",
        "package/dist/mermaid.min.js",
        (),
    ),
}


def package_dir(name: str) -> Path:
    version = PACKAGES[name][0]
    return CACHE / f"{name}-{version}"


def fetch(name: str, log=print) -> Path:
    """Download, verify and unpack one package into the cache (a no-op when it is already there)."""
    version, integrity, prefix, leave_out = PACKAGES[name]
    dest = package_dir(name)
    stamp = dest / ".complete"
    if stamp.exists():
        return dest
    url = f"https://registry.npmjs.org/{name}/-/{name}-{version}.tgz"
    log(f"[vendor] fetching {url}")
    with urllib.request.urlopen(url, timeout=120) as response:
        data = response.read()
    algo, _, expected = integrity.partition("-")
    digest = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if digest != expected:
        raise RuntimeError(f"{url}: integrity mismatch ({algo} {digest} != {expected})")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            rel = member.name[len(prefix):] or Path(prefix).name
            if rel in leave_out or rel.endswith(".map"):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    stamp.write_text(f"{name} {version}\n")
    return dest


def fetch_all(log=print) -> None:
    for name in PACKAGES:
        fetch(name, log=log)


# --- mkdocs hook -----------------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        fetch_all(log=lambda msg: print(msg, file=sys.stderr))
    except Exception as exc:  # no network and an empty cache
        raise PluginError(f"could not fetch MathJax/mermaid into {CACHE} ({exc}); "
                          "run scripts/setup.sh dev once with network") from exc
    for name in PACKAGES:
        src = package_dir(name)
        for path in sorted(src.rglob("*")):
            if path.is_file() and path.name != ".complete":
                rel = f"{SITE_PREFIX}/{name}/{path.relative_to(src).as_posix()}"
                files.append(File.generated(config, rel, abs_src_path=str(path)))
    return files


if __name__ == "__main__":
    fetch_all()
    print(f"[vendor] MathJax and mermaid ready in {CACHE}")
