"""The training wing: ``scanax.fit`` and what it is made of (see
``docs/architecture.md``)."""
