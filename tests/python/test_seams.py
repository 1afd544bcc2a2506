"""Features built on a CheckpointedOptimizer use its public seam, never its
private members ([architecture2] item 2).

LowDiff, LowDiff+, CPR and the table readers once reached into
`ckpt._engine`, `ckpt._stepper` and friends in about 20 places, so a change
inside the optimizer broke them unseen. Checked here on the source: no
module of the package but the optimizer's own (optimizer.py and its base in
update_in_backward.py) reads or writes a private attribute of a
CheckpointedOptimizer on anything but `self`.
"""

import ast
import os

import torch

import pmsnap

PACKAGE = os.path.dirname(pmsnap.__file__)
OWN = ("optimizer.py", "update_in_backward.py")


def _private_members():
    """Private attributes and methods the optimizer's own modules define on
    self, less those torch's modules and optimizers have under the same name
    (nn.Module._buffers is not ours)."""
    names = set()
    for own in OWN:
        tree = ast.parse(open(os.path.join(PACKAGE, own)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") \
                    and not node.name.startswith("__"):
                names.add(node.name)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                names.add(node.attr)
    return names - set(dir(torch.nn.Linear(1, 1))) - set(dir(torch.optim.Optimizer))


def _reach_throughs(source, private):
    """(line, expression) of each private member in `private` used on an
    object other than `self`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reaches_into_a_checkpointed_optimizer():
    private = _private_members()
    assert {"_engine", "_stepper", "_coordinator", "_open_or_raise"} <= private
    offences = []
    for name in sorted(os.listdir(PACKAGE)):
        if not name.endswith(".py") or name in OWN:
            continue
        source = open(os.path.join(PACKAGE, name)).read()
        offences += [f"{name}:{line}: {expr}" for line, expr in _reach_throughs(source, private)]
    assert not offences, "private members of CheckpointedOptimizer used outside it:\n" + \
        "\n".join(offences)


def test_the_check_catches_a_reach_through():
    private = _private_members()
    assert _reach_throughs("x = self.ckpt._engine.stats()\n", private) == \
        [(1, "self.ckpt._engine")]
    assert _reach_throughs("self._engine = None\n", private) == []
