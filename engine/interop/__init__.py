"""The engine's names next to other libraries' names.

    mappers  our addresses <-> TransformerLens, nnsight/nnterp and HF module names
    docs     docs/points.md rendered from the point registry and the families
"""
