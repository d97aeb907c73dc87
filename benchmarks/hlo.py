"""The FLOPs of an XLA computation, read from its HLO text: the dots and
convolutions that remain live (backend-neutral: TensorFlow and JAX lower
to the same HLO)."""

import re

import numpy as np

_DEFINITION = re.compile(r"%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_OPERATION = re.compile(
    r"%[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+(dot|convolution)\(([^)]*)\)"
    r"(.*)")
_OPERAND = re.compile(r"(?:\w+\[([\d,]*)\]\S*\s+)?%([\w.\-]+)")


def _dims(text):
    return [int(d) for d in text.split(",") if d]


_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)")


def _live_instructions(hlo_text):
    """The lines of the instructions some computation's result depends on.

    TensorFlow lowers every op of a traced step, gradients nobody asked for
    included (a convolution's input gradient on the data, say); XLA drops
    those when it optimises, and so does this count.
    """
    definitions, roots = {}, []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        root, name, rest = match.groups()
        definitions[name] = (line, re.findall(r"%([\w.\-]+)", rest))
        if root:
            roots.append(name)
    live, pending = set(), roots
    while pending:
        name = pending.pop()
        if name in live or name not in definitions:
            continue
        live.add(name)
        pending.extend(definitions[name][1])
    return [definitions[name][0] for name in live]


def hlo_flops(hlo_text):
    """Floating-point operations of the live dots and convolutions of an
    HLO module's text, as XLA prints it before optimising: 2 per
    multiply-add of what the model asks for (operand shapes are read from
    the operands, or from their definitions where XLA does not print them).

    Elementwise work is not counted; a loop body is counted once, however
    many times it runs.
    """
    shapes = {name: _dims(dims)
              for name, dims in _DEFINITION.findall(hlo_text)}
    total = 0
    for line in _live_instructions(hlo_text):
        match = _OPERATION.search(line)
        if not match:
            continue
        out, kind, operands, attributes = match.groups()
        operands = [_dims(dims) if dims else shapes.get(name)
                    for dims, name in _OPERAND.findall(operands)][:2]
        if len(operands) != 2 or None in operands:
            continue
        (lhs, rhs), out = operands, _dims(out)
        if kind == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}",
                                    attributes)
            depth = np.prod([lhs[i] for i in _dims(contracting.group(1))]
                            ) if contracting else 1
        else:
            labels = re.search(r"dim_labels=\w+_(\w+)->", attributes)
            # Every output element sums the kernel's spatial window times
            # its input features (per group): all kernel axes but `o`.
            depth = np.prod(rhs) // rhs[labels.group(1).index("o")]
        total += 2 * int(np.prod(out)) * int(depth)
    return total
