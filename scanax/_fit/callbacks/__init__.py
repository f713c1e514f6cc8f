"""``fit``'s features, one module each (the protocol: ``_fit.feature``)."""
