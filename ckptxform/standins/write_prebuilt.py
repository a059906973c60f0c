"""``python -m ckptxform.standins.write_prebuilt``: rewrite the shipped stand-ins torch writes
(``ckptxform/standins/prebuilt/``) with the torch installed here."""

from __future__ import annotations

import shutil

from .for_rules import TORCH_WRITTEN
from .prebuilt import PREBUILT_DIR, write_prebuilt

if __name__ == "__main__":
    for stem, build in sorted(TORCH_WRITTEN.items()):
        shutil.rmtree(PREBUILT_DIR / stem, ignore_errors=True)
        write_prebuilt(build, PREBUILT_DIR / stem)
        print(f"wrote {PREBUILT_DIR / stem}")
