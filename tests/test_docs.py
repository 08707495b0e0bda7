"""Every Python example in README.md and docs/*.md runs.

The blocks of one file run in order in one namespace, as a reader would run them.
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


# Docs whose every Python example another test already runs (and asserts there are no
# others), so running them here again would only double the suite's longest Ray launches.
RUN_ELSEWHERE = {"distributed.md": "tests/test_ray_launch.py (docs_run and the restart test)"}


def _docs_with_code():
    for path in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", open(path).read(), flags=re.S)
        if blocks and os.path.basename(path) not in RUN_ELSEWHERE:
            yield pytest.param(blocks, id=os.path.basename(path))


@pytest.mark.parametrize("blocks", list(_docs_with_code()))
def test_doc_examples_run(blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_example__"}
    for code in blocks:
        exec(compile(code, "<doc>", "exec"), namespace)
