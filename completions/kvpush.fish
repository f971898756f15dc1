# fish completion for kvpush 0.1.0. Generated from the CLI by
# 'python -m kvpush.cli.gendocs' (also: 'kvpush completion fish'); do not edit.
# Install: kvpush completion fish > ~/.config/fish/completions/kvpush.fish
complete --command kvpush --no-files --arguments "(env _KVPUSH_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) kvpush)" --condition "env _KVPUSH_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=is-args _TYPER_COMPLETE_ARGS=(commandline -cp) kvpush"
