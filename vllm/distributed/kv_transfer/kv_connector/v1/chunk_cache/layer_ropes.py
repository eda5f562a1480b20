# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which rotary embedding each attention layer's keys went through.

Read once at start-up from the model the runner registers (the connector's
`register_model` hook): a load re-rotates a layer's cached keys with that
rope, so a layer whose rope cannot be told for certain refuses the start.
"""

import ast
import inspect
import textwrap
from typing import Any

from torch import nn


def rope_use(owner: nn.Module) -> str:
    """How the forward of `owner` (the module holding `rotary_emb` and an
    attention layer) uses its rotary embedding, read from its source:
    "always", "never", or "conditional"/"unknown" (cannot be told: refuse).

    A test that reads only the module's own state is decided for this owner
    (the branch taken counts, the other is dead): `self.rotary_emb is not
    None`, `isinstance(self.rotary_emb, X)` with X named in the forward's
    module (vllm-ascend's Qwen3 M-RoPE path), plain constants set at
    construction (`if self._use_rope:`, OLMo); `is None`, `==`, `not`, `and`,
    `or`. Anything else, or an attribute the forward assigns, stays undecided.
    """
    parsed = _forward_tree(type(owner))
    if parsed is None:
        return "unknown"
    func, names, assigned = parsed
    uses: list[bool] = []  # one per mention of self.rotary_emb: conditional?

    def decide(test: ast.AST) -> bool | None:
        value = _state_value(test, owner, names, assigned)
        return None if value is _UNDECIDED else bool(value)

    def visit(node: ast.AST, conditional: bool) -> None:
        if isinstance(node, (ast.If, ast.IfExp)):
            taken = decide(node.test)
            if taken is not None:
                branch = node.body if taken else node.orelse
                for taken_node in branch if isinstance(branch, list) else [branch]:
                    visit(taken_node, conditional)
                return
        if _dotted(node) == ("self", "rotary_emb"):
            uses.append(conditional)
        nested = conditional or isinstance(node, _BRANCHING + _SCOPES)
        for child in ast.iter_child_nodes(node):
            # The test of an `if` is evaluated unconditionally, but a
            # rotary_emb mentioned there still decides the branch.
            visit(child, nested)

    for stmt in func.body:
        visit(stmt, False)
    if not uses:
        # Unused, or applied through a helper not followed: "never" only when
        # no other method mentions it.
        for name, member in inspect.getmembers(type(owner), inspect.isfunction):
            if name in ("forward", "__init__"):
                continue
            try:
                if "rotary_emb" in inspect.getsource(member):
                    return "unknown"
            except (OSError, TypeError):
                return "unknown"
        return "never"
    return "conditional" if any(uses) else "always"


def _dotted(node: ast.AST) -> tuple[str, ...] | None:
    """("a", "b", "c") for the expression `a.b.c`, else None."""
    path: list[str] = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    return (node.id, *reversed(path)) if isinstance(node, ast.Name) else None


# Nodes whose children may run conditionally, or not at all.
_BRANCHING = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.BoolOp, ast.Match)
_SCOPES = (ast.Lambda, ast.FunctionDef, ast.comprehension)
_UNDECIDED = object()
# Values a test may read from the module's state: what a constructor sets
# from the config (a tensor or a module has no unambiguous truth value).
_PLAIN = (type(None), bool, int, float, str)


def _forward_tree(
    cls: type[nn.Module],
) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, dict[str, Any], set[str]] | None:
    """(the forward's FunctionDef, its module globals, the `self` attributes
    the forward assigns) for `cls`, or None when its source cannot be read."""
    forward = cls.forward
    try:
        func = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    assigned = {
        dotted[1]
        for node in ast.walk(func)
        for target in _assign_targets(node)
        if (dotted := _dotted(target)) and len(dotted) == 2 and dotted[0] == "self"
    }
    return func, getattr(forward, "__globals__", {}), assigned


def _assign_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets: list[ast.expr] = []
        for target in node.targets:
            targets.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _state_value(test: ast.AST, owner: object, names: dict, assigned: set[str]):
    """The value of `test` read from `owner`'s state alone (see `rope_use`),
    or _UNDECIDED."""

    def attribute(node: ast.AST):
        path = _dotted(node)
        if path is None or path[0] != "self" or len(path) < 2 or path[1] in assigned:
            return _UNDECIDED
        value = owner
        for attr in path[1:]:
            # NOTE: inspect.getattr_static would miss nn.Module's submodules.
            if not hasattr(value, attr):
                return _UNDECIDED
            value = getattr(value, attr)
        return value

    def plain(node: ast.AST):
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, _PLAIN) else _UNDECIDED
        value = evaluate(node)
        return value if value is _UNDECIDED or isinstance(value, _PLAIN) else _UNDECIDED

    def evaluate(node: ast.AST):
        if isinstance(node, ast.Attribute):
            return attribute(node)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = plain(node.operand)
            return _UNDECIDED if value is _UNDECIDED else not value
        if isinstance(node, ast.BoolOp):
            values = [plain(v) for v in node.values]
            if any(v is _UNDECIDED for v in values):
                return _UNDECIDED
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op, right = node.ops[0], node.comparators[0]
            if isinstance(op, (ast.Is, ast.IsNot)):
                if not (isinstance(right, ast.Constant) and right.value is None):
                    return _UNDECIDED
                left = evaluate(node.left)
                if left is _UNDECIDED:
                    return _UNDECIDED
                return (left is None) == isinstance(op, ast.Is)
            left, value = plain(node.left), plain(right)
            if left is _UNDECIDED or value is _UNDECIDED:
                return _UNDECIDED
            compare = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
            fn = compare.get(type(op))
            return _UNDECIDED if fn is None else fn(left, value)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and names.get("isinstance", isinstance) is isinstance
            and len(node.args) == 2
            and not node.keywords
        ):
            subject = attribute(node.args[0])
            classes = _resolve_classes(node.args[1], names)
            if subject is _UNDECIDED or classes is None:
                return _UNDECIDED
            return isinstance(subject, classes)
        return _UNDECIDED

    value = evaluate(test)
    if value is _UNDECIDED or isinstance(test, (ast.Compare, ast.Call)):
        return value
    # A bare value decides the branch by its truth: a plain constant only.
    return value if isinstance(value, _PLAIN) else _UNDECIDED


def _resolve_classes(node: ast.AST, names: dict) -> tuple[type, ...] | None:
    """Classes named by `node` (a name, a dotted name or a tuple of them) in
    the module globals `names`; None if any is not a class found there."""
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    classes = []
    for item in items:
        path = _dotted(item)
        if path is None or path[0] not in names:
            return None
        value = names[path[0]]
        for attr in path[1:]:
            value = getattr(value, attr, None)
        if not isinstance(value, type):
            return None
        classes.append(value)
    return tuple(classes)


def find_layer_ropes(
    model: nn.Module,
) -> tuple[dict[str, nn.Module | None], list[str]]:
    """Attention layer name -> the rotary embedding its keys went through
    (None: no RoPE on that layer), and the attention layers whose rope could
    not be found although the model uses RoPE. The rope is the `rotary_emb`
    of the module owning the layer (vLLM's decoder models), as `rope_use`
    reads its forward."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ropes: dict[str, nn.Module | None] = {}
    orphans: list[str] = []
    any_rope = False
    for _, module in model.named_modules():
        rope = getattr(module, "rotary_emb", None)
        if not isinstance(rope, nn.Module):
            rope = None
        attentions = [
            c for c in module.children() if isinstance(c, (Attention, MLAAttention))
        ]
        if rope is not None and attentions:
            cls = type(module)
            # NOTE: per module, not per class: a forward's test may read the
            # module's state (the rope's type, a flag set from the config).
            use = rope_use(module)
            if use in ("conditional", "unknown"):
                raise ValueError(
                    f"--enable-chunk-cache cannot tell whether {cls.__name__} "
                    f"applies its rotary_emb to the keys of "
                    f"{attentions[0].layer_name} ({use} use in its forward): "
                    "unsupported model structure"
                )
            if use == "never":
                rope = None
        if rope is not None:
            any_rope = True
        for child in attentions:
            child_rope = rope
            if child_rope is None and isinstance(child, MLAAttention):
                # vllm-ascend's MLA implementation applies the model's rope
                # itself (docs/ascend.md).
                impl_rope = getattr(getattr(child, "impl", None), "rotary_emb", None)
                child_rope = impl_rope if isinstance(impl_rope, nn.Module) else None
            if child_rope is not None:
                any_rope = True
            ropes[child.layer_name] = child_rope
    if any_rope:
        orphans = [name for name, rope in ropes.items() if rope is None]
    return ropes, orphans
