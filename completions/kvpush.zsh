#compdef kvpush
# zsh completion for kvpush 0.1.0. Generated from the CLI by
# 'python -m kvpush.cli.gendocs' (also: 'kvpush completion zsh'); do not edit.
# Install: kvpush completion zsh > "${fpath[1]}/_kvpush"   (then: compinit)

_kvpush_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _KVPUSH_COMPLETE=complete_zsh kvpush)
}

compdef _kvpush_completion kvpush
