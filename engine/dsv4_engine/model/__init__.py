"""The DeepSeek-V4 model in torch; parameter names equal HF `DeepseekV4ForCausalLM`'s."""

from dsv4_engine.model.cache import SeqCache
from dsv4_engine.model.extend import ForwardBatch, SeqSlice
from dsv4_engine.model.model import Dsv4ForCausalLM

__all__ = ["Dsv4ForCausalLM", "ForwardBatch", "SeqCache", "SeqSlice"]
