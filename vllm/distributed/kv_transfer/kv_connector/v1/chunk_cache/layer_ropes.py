# SPDX-License-Identifier: Apache-2.0
"""Which rotary embedding each attention layer's keys went through.

Read once at start-up from the model the runner registers (the connector's
`register_model` hook): a load re-rotates a layer's cached keys with that
rope, so a layer whose rope cannot be told for certain refuses the start.
"""

import ast
import inspect
import textwrap

from torch import nn


def rope_use(owner: nn.Module) -> str:
    """How the forward of `owner` (the module holding `rotary_emb` and an
    attention layer) uses its rotary embedding, read from its source:
    "always" (called unconditionally in forward), "never" (forward does not
    mention it) or "conditional"/"unknown" (cannot be told: refuse).

    Two tests of the rope object itself are decided for this owner's rope,
    the branch taken is read as unconditional and the other one as dead:
    `if self.rotary_emb is not None:` (vLLM's MLA wrapper: with a rope, its
    body runs), and `if isinstance(self.rotary_emb, X):` with X a class (or
    tuple of classes) named in the forward's module (vllm-ascend's
    patch_qwen3vl forward of Qwen3 and Qwen3-MoE attention: a fused M-RoPE
    path for AscendMRotaryEmbedding, the plain rope call otherwise).
    """
    forward = type(owner).forward
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return "unknown"
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "unknown"
    uses: list[bool] = []  # one per mention of self.rotary_emb: conditional?
    rope = getattr(owner, "rotary_emb", None)
    names = getattr(forward, "__globals__", {})

    def visit(node: ast.AST, conditional: bool) -> None:
        if isinstance(node, ast.If):
            taken = _rope_test_outcome(node.test, rope, names)
            if taken is not None:
                for child in node.body if taken else node.orelse:
                    visit(child, conditional)
                return
        if _is_self_rope(node):
            uses.append(conditional)
        nested = conditional or isinstance(
            node,
            (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.BoolOp,
             ast.Match, ast.Lambda, ast.FunctionDef, ast.comprehension),
        )
        for child in ast.iter_child_nodes(node):
            # The test of an `if` is evaluated unconditionally, but a
            # rotary_emb mentioned there still decides the branch.
            visit(child, nested)

    for stmt in func.body:
        visit(stmt, False)
    if not uses:
        # Not in forward: either unused, or applied through a helper we do
        # not follow. Only "unused" is safe when the class has no other
        # method that mentions it.
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


def _is_self_rope(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "rotary_emb"
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _rope_test_outcome(test: ast.AST, rope: object, names: dict) -> bool | None:
    """The value of an `if` test on the rope object alone, for this `rope`:
    `self.rotary_emb is not None`, `isinstance(self.rotary_emb, X)` (X a
    class or tuple of classes resolved in the forward's globals `names`),
    either under `not`; None for any other test (or an X not resolved)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _rope_test_outcome(test.operand, rope, names)
        return None if inner is None else not inner
    if (isinstance(test, ast.Compare) and _is_self_rope(test.left)
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):
        return rope is not None
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name)
            and test.func.id == "isinstance" and names.get("isinstance", isinstance) is isinstance
            and len(test.args) == 2 and not test.keywords and _is_self_rope(test.args[0])):
        classes = _resolve_classes(test.args[1], names)
        if classes is not None:
            return isinstance(rope, classes)
    return None


def _resolve_classes(node: ast.AST, names: dict) -> tuple[type, ...] | None:
    """Classes named by `node` (a name, a dotted name or a tuple of them) in
    the module globals `names`; None if any is not a class found there."""
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    classes = []
    for item in items:
        path = []
        while isinstance(item, ast.Attribute):
            path.append(item.attr)
            item = item.value
        if not isinstance(item, ast.Name) or item.id not in names:
            return None
        value = names[item.id]
        for attr in reversed(path):
            value = getattr(value, attr, None)
        if not isinstance(value, type):
            return None
        classes.append(value)
    return tuple(classes)


def _rope_of_mla_impl(layer: nn.Module) -> nn.Module | None:
    """The rope an MLA implementation applies itself, when the module that
    owns the layer keeps none: vllm-ascend's `AscendMultiHeadLatentAttention`
    hands the model's rope to `MLAAttention` and `AscendMLAImpl` rotates k_pe
    in every path of its forward (read in vllm-ascend 0.23.0.post1,
    docs/ascend.md). Only an implementation with a registered latent writer
    is loaded at all (support.check_attention_layer), so this names the rope
    of those alone."""
    rope = getattr(getattr(layer, "impl", None), "rotary_emb", None)
    return rope if isinstance(rope, nn.Module) else None


def find_layer_ropes(
    model: nn.Module,
) -> tuple[dict[str, nn.Module | None], list[str]]:
    """Attention layer name -> the rotary embedding its keys went through
    (None: no RoPE on that layer: the model has none, or the layer keeps a
    `rotary_emb` its forward never calls); plus the names of attention
    layers whose rope could not be found although the model uses RoPE.

    The rope is the `rotary_emb` of the module that owns the attention
    layer (the convention of vLLM's decoder models), and it must be applied
    unconditionally by that module's forward. A module that applies it
    conditionally (NoPE layers chosen by config) is refused: we cannot tell
    which layers' keys carry RoPE.
    """
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ropes: dict[str, nn.Module | None] = {}
    orphans: list[str] = []
    any_rope = False
    use_by_class: dict[tuple[type, type], str] = {}
    for _, module in model.named_modules():
        rope = getattr(module, "rotary_emb", None)
        if not isinstance(rope, nn.Module):
            rope = None
        attentions = [c for c in module.children()
                      if isinstance(c, (Attention, MLAAttention))]
        if rope is not None and attentions:
            cls = type(module)
            # NOTE: per rope class too: a forward may test the rope's type.
            key = (cls, type(rope))
            if key not in use_by_class:
                use_by_class[key] = rope_use(module)
            use = use_by_class[key]
            if use in ("conditional", "unknown"):
                raise ValueError(
                    f"chunk cache cannot tell whether {cls.__name__} applies its "
                    f"rotary_emb to the keys of {attentions[0].layer_name} "
                    f"({use} use in its forward): unsupported model structure"
                )
            if use == "never":
                rope = None
        if rope is not None:
            any_rope = True
        for child in attentions:
            child_rope = rope
            if child_rope is None and isinstance(child, MLAAttention):
                child_rope = _rope_of_mla_impl(child)
            if child_rope is not None:
                any_rope = True
            ropes[child.layer_name] = child_rope
    if any_rope:
        orphans = [name for name, rope in ropes.items() if rope is None]
    return ropes, orphans
