"""The public API of ``import raytrain``: what it exports and the module each name lives in, written once.

Type checkers read this stub; at import, lazy_loader reads it too (``raytrain/__init__.py``) and imports
each name from its module on first use.
"""

from .contracts.result import RunResult as RunResult
from .errors import Fatal as Fatal
from .errors import UserError as UserError
from .service.checkpoint_index import checkpoint_damage as checkpoint_damage
from .service.collectives import all_reduce as all_reduce
from .service.collectives import broadcast as broadcast
from .service.config import RunConfig as RunConfig
from .service.config import ScaleConfig as ScaleConfig
from .service.config import Tracker as Tracker
from .service.events import Report as Report
from .service.placement import Plan as Plan
from .service.preemption import ending_in as ending_in
from .service.preemption import ending_reason as ending_reason
from .service.preemption import ending_soon as ending_soon
from .service.runs import RunDir as RunDir
from .service.runs import Storage as Storage
from .service.sharded import full_weights as full_weights
from .service.sharded import load_sharded as load_sharded
from .service.sharded import save_sharded as save_sharded
from .service.sharded import save_whole as save_whole
from .service.sharded import shard as shard
from .service.sharded import wait_sharded as wait_sharded
from .service.sweep_space import SearchSpace as SearchSpace
from .service.telemetry import progress as progress
from .service.trainer import train as train
from .service.workload import Placed as Placed
from .service.workload import TrainFunction as TrainFunction
from .service.workload import Workload as Workload

__version__: str
__all__: list[str]
