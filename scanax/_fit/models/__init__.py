"""The model kinds ``fit`` trains (NNX, optax over a pytree, TrainState) and
a population of members, as flat leaves."""
