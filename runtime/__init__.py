"""medusa_trt.runtime: tree compiler, acceptance rules, engine backends and ``MedusaRuntime``.

Importing this package pulls in numpy only; a backend imports its framework when it is built.
"""

from medusa_trt.runtime.config import RuntimeConfig
from medusa_trt.runtime.engine import EngineError, EngineMeta
from medusa_trt.runtime.medusa import MedusaRuntime
from medusa_trt.runtime.results import GenerationResult, GenerationStats, StreamEvent
from medusa_trt.runtime.text import PromptError
from medusa_trt.runtime.tree import CompiledTree, InvalidTreeError, compile_tree, load_tree

__all__ = [
    "CompiledTree",
    "EngineError",
    "EngineMeta",
    "GenerationResult",
    "GenerationStats",
    "InvalidTreeError",
    "MedusaRuntime",
    "PromptError",
    "RuntimeConfig",
    "StreamEvent",
    "compile_tree",
    "load_tree",
]
