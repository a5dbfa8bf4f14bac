"""Floor 1, pure: sharding propagation, from an op's rule to the layouts it runs in.

``rules`` is the table of factor rules (einsum-like notation, one small rule per op
family, each family's builder beside it), ``binding`` binds a rule to operand shapes,
and ``decide`` picks one sharding per factor by cost. Pure Python over layouts and
shapes: nothing here imports torch or touches a Tensor.
"""
