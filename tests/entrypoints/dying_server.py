"""`baby-sgl serve`, except that the scheduler thread dies (a BaseException the loop does not
survive) when a request with rid "die" arrives. Used by test_server_process.py."""

import sys

from baby_sgl.launch_server import main
from baby_sgl.managers.scheduler.scheduler import Scheduler


class Fatal(BaseException):
    pass


_real_step = Scheduler.step


def _step(self):
    if any(r.rid == "die" for r in self.queues.waiting):
        raise Fatal("injected scheduler death")
    return _real_step(self)


if __name__ == "__main__":
    Scheduler.step = _step
    sys.exit(main(sys.argv[1:]))
