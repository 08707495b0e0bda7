"""Recognise a write refused for lack of room (full disk, quota, file-size limit).

Why: such a failure is the user's to fix (free space, move ``output_dir``) and must end a
run with one line, not a traceback. Orbax's writers do not raise the ``OSError`` itself:
TensorStore reports it inside a ``ValueError`` whose text ends in
``No space left on device [os_error_code='28']``, so both forms are recognised.
"""

from __future__ import annotations

import errno

NO_ROOM = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
           errno.EFBIG: "File too large"}


def no_room(err: BaseException | None) -> str | None:
    """The reason (``strerror``) if ``err`` or an exception it wraps is a write refused for lack of room."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            return NO_ROOM[err.errno]
        text = str(err)
        for code, reason in NO_ROOM.items():
            if reason in text or f"os_error_code='{code}'" in text:
                return reason
        err = err.__cause__ or err.__context__
    return None
