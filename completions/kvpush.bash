# bash completion for kvpush 0.1.0. Generated from the CLI by
# 'python -m kvpush.cli.gendocs' (also: 'kvpush completion bash'); do not edit.
# Install: kvpush completion bash > ~/.local/share/bash-completion/completions/kvpush
_kvpush_completion() {
    local IFS=$'
'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _KVPUSH_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _kvpush_completion kvpush
