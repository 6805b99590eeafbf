from plugins.operators.process import SupervisedProcessOperator
from plugins.operators.finalize import FinalizeRunOperator
from plugins.operators.rlhf import RlhfProcessOperator, engine_command

__all__ = ["FinalizeRunOperator", "RlhfProcessOperator", "SupervisedProcessOperator", "engine_command"]
