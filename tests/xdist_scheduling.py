"""The suite's pytest-xdist scheduler: whole files per worker, the Ray tests grouped and first, and a lost
worker's files handed to another worker instead of a suite that waits for good.

pytest-xdist 3.8's ``LoadFileScheduling`` (``LoadScopeScheduling``) hangs when a worker dies (the kernel
killing it for memory on a busy machine, an abort inside a native library), in three ways we saw or
reproduced (tests/test_xdist_scheduling.py):

- ``remove_node`` puts the dead worker's whole workload back on the queue, files it had finished
  included; a replacement handed one of those is sent no test and never reports back, so it is never
  given more work.
- A replacement is rescheduled once, when its collection arrives, and gets one file. A worker runs a
  test only once it holds the next one (or is told to shut down), so a file with one test left waits
  for a second file that is never sent while the other files stay queued: the controller and both
  workers wait on each other.
- The test the worker died in stays pending, so the replacement runs it again and dies again, until
  ``--max-worker-restart`` is spent and the rest of its file is never run.

Here the dead worker's test is reported failed once (xdist's ``handle_crashitem`` does that) and not
run again, the unfinished rest of its files goes back to the front of the queue, and a worker is
topped up until it holds two tests or the queue is empty, when it is told to shut down so it runs its
last test. A run that loses a worker ends, failed, naming the test it died in.
"""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController


def runs_ray(nodeid: str) -> bool:
    """Tests that start Ray: every ``test_ray*`` file and ``test_ray*`` tests elsewhere (the marked one in
    test_seed_examples). By node id, because the xdist controller sees only node ids."""
    path, _, name = nodeid.partition("::")
    return path.rsplit("/", 1)[-1].startswith("test_ray") or name.startswith("test_ray")


class RayFirstFileScheduling(LoadFileScheduling):
    """One test file per unit of work, every Ray test in one unit; survives a worker that dies."""

    def _split_scope(self, nodeid: str) -> str:
        return "ray" if runs_ray(nodeid) else super()._split_scope(nodeid)

    def add_node_collection(self, node: WorkerController, collection: list[str]) -> None:
        """As xdist, and a replacement whose collection differs (xdist logs the difference and ignores it) is
        told to shut down: it would otherwise wait for work it can never be given."""
        super().add_node_collection(node, collection)
        if node not in self.registered_collections:
            node.shutdown()

    def remove_node(self, node: WorkerController) -> str | None:
        """Forget ``node``; if it died with tests to run, return the one it died in and requeue the rest."""
        workload = self.assigned_work.pop(node)  # KeyError for a node never added: DSession expects that
        crashitem = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
        if crashitem is None:
            return None
        workload[self._split_scope(crashitem)][crashitem] = True  # reported failed by DSession; not run again
        unfinished = OrderedDict((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
        # first, so the rest of a file a worker died in runs next rather than at the end of the suite
        for scope, unit in reversed(unfinished.items()):
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
        for other in self.nodes:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: WorkerController) -> None:
        """Top ``node`` up to two pending tests (a worker runs a test once it holds the next one); tell it
        to shut down once the queue is empty, so it runs its last test and ends."""
        if node.shutting_down or node not in self.registered_collections:
            return
        workload = self.assigned_work[node]
        if self.workqueue and self._pending_of(workload) <= 2:  # xdist's own heuristic: one more file
            self._assign_work_unit(node)
        while self.workqueue and self._pending_of(workload) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()
