"""vlmrl: multi-turn, tool-using reinforcement learning of vision-language models."""

from vlmrl import _moved

_moved.install()
