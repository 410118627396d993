"""A YAML file is checked before Hydra or OmegaConf reads it: UTF-8 text, valid YAML, and no bigger once its aliases
are expanded than `MAX_NODES` nodes. PyYAML keeps an alias as a reference to its anchor's node, so a few hundred
bytes of nested aliases (a "billion laughs" file) compose in microseconds but expand into a tree of billions of
nodes when OmegaConf copies it into a config; the expanded size is counted on the composed node graph (each node
counted once per reference, memoised), in time linear in the file. Every failure is a one-line `ConfigError` naming
the setting and the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from vlmrl.errors import ConfigError

MAX_NODES = 1_000_000  # nodes of the expanded YAML tree (a config has a few hundred)


def check_yaml_file(path: Path, key: str) -> None:
    """Raise ConfigError naming `key` (e.g. `recipe=X`) and `path` when the file is not UTF-8 text, not valid YAML,
    or expands past `MAX_NODES` nodes."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{key}: {path} is not UTF-8 text (byte {err.start}); a config file is YAML text") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: {path} is not valid YAML ({first})") from None
    try:
        size = expanded_size(node, {})
    except RecursionError:
        raise ConfigError(f"{key}: {path} nests too deeply") from None
    if size > MAX_NODES:
        raise ConfigError(
            f"{key}: {path} expands into more than {MAX_NODES:,} YAML nodes through its aliases (a config has a few "
            "hundred); write the values out instead of nesting aliases"
        )


def expanded_size(node: yaml.Node | None, memo: dict[int, int]) -> int:
    """Nodes of `node`'s tree with every alias expanded (`memo`: node id -> size, so shared nodes cost once)."""
    if node is None:
        return 0
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_NODES + 1  # a node that contains itself (a recursive alias) expands without end
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(expanded_size(k, memo) + expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size = min(size, MAX_NODES + 1)
    return size
