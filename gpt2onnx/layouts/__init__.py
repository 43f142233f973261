"""K/V cache layouts as plug-ins: one module each (concat, shared, static), registered in all_layouts."""
