"""The base of every error a user can cause: commands print its message as one line, exit 2."""


class MedusaError(ValueError):
    """A user-caused error (bad model, heads, tree, engine, prompt); the message says what to do."""
