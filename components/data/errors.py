"""The data package's one error: a dataset, record, tokenizer or loader state the user can fix."""

from __future__ import annotations

from weft.errors import UserError


class DataError(UserError):
    """A dataset or tokenizer problem; the message names the path or value and what was expected."""
