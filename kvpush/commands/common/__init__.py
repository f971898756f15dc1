"""What several commands share: the options and their parsing, the control client of an
endpoint, result records, node launching, the registry reader and the shared views."""
