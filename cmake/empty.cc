// The shared library's own translation unit: its code is the module archives linked whole.
