"""The trial controller: an explicit state machine that runs one trial on a worker group.

- `states.py`: the states, each a small class whose `run` returns the next state;
- `machine.py`: the loop that runs them (`TrialController`);
- `trial.py`: the trial's shared state and the actions several states take;
- `timeline.py`: failures and the times of their recovery phases (pure);
- `standby.py`: replica holders and hot spares; `regrow.py`: elastic regrow;
- `watchdog.py`: the stall watchdog (pure); `final_check.py`: the final digest (pure);
- `chaos_link.py`: the chaos actor, seen from the driver; `calls.py`: calling the ranks;
- `callbacks.py`: metrics, logs and progress, told of what happens.
"""

from failbench_ray.controller.calls import Gathered, gather
from failbench_ray.controller.machine import TrialController
from failbench_ray.controller.trial import TrialOutcome

__all__ = ["Gathered", "TrialController", "TrialOutcome", "gather"]
