"""Pull the runnable examples out of the docs: a ```python block after ``<!-- test: NAME -->``."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_blocks(relpath: str) -> dict[str, str]:
    text = open(os.path.join(ROOT, relpath)).read()
    return dict(re.findall(r"<!-- test: ([\w-]+) -->\s*```python\n(.*?)```", text, flags=re.S))


def python_blocks(relpath: str) -> list[str]:
    text = open(os.path.join(ROOT, relpath)).read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)
