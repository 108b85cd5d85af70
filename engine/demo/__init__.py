"""What the command line trains (``models``, ``data``, ``corpus``): a user's own model needs
none of it, and the library imports nothing from here."""
