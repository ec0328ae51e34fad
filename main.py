"""DLRM training in a checkout: `python main.py --dataset_path DIR [flags]`.

The same as the installed `dlrm-train` command (`dlrm/cli.py` defines the flags;
`python main.py --help` lists them).
"""

from dlrm.cli import console_main

if __name__ == "__main__":
    console_main()
