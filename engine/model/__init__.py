"""The backend-free model surface: what every loaded model offers whichever backend runs it.

    base          ModelBase: the methods every backend's model shares
    capabilities  describe(): what this model serves, point by point, with the reasons for gaps
    catalogue     PointCatalogue: the points this model has, by layer
    paths         get_path: a dotted path walked in a module tree
    lens          the logit lens (final norm + unembedding, with the family's softcap)
    weights       the weight layout (which parameter holds what) for the lens and the mappers
    sources       where a model comes from: the real checkpoint if cached, else its zoo twin
    options       load options (device, dtype, backend knobs) checked once
    sampling      the sampling knobs every backend takes
"""
