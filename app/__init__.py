"""imagetune's web UI (Gradio). It never imports torch: it starts runs through `trainer.core.launcher` and only reads
run folders, so a browser refresh or a restart of the UI re-attaches to running jobs (README: The run folder).

    app.main      main(host, port, auth, share, insecure, runs_dir): checks, then serves the UI
    app.security  who may connect (auth, host), which paths may be typed in (workspace confinement)
    app.forms     the settings form generated from trainer.core.config.schema; form <-> values <-> YAML; validation
    app.presets   shipped presets (read-only) and the user's own
    app.jobs      hardware probe, starting / stopping / resuming / deleting runs in the background
    app.runs      run folders -> runs table, progress, loss/lr series, sample galleries, log tail
    app.dataset_check  the dataset check page's content
    app.ui*       the Gradio layout and its wiring
"""
