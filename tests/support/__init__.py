"""What the tests share: the repository's paths, and helpers (multi-process runs, the failure
contract, tokenizer and Hugging Face folders, models weft did not write, in-process train runs)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the checkout
ASSETS = REPO / "assets"

from tests.support import slow_scaled_mm as _slow_scaled_mm  # noqa: E402

_slow_scaled_mm.install()  # only with WEFT_SLOW_SCALED_MM set
