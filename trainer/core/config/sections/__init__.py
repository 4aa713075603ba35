"""The config sections only some families read (`flow:`, `detection:`): torch-free data the schema holds one field
of each, here in core so that the schema never imports a family (the families import their section from here)."""
