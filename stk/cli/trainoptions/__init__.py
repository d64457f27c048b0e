"""stk-train's options, one module per group of them by what they are about; stk/cli/train.py applies the groups
in the order --help lists them."""
