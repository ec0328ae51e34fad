"""DLRM training in a checkout: `python main.py --dataset_path DIR [flags]`.

The same as the installed `dlrm-train` command (`dlrm/app/flags.py` defines the flags;
`python main.py --help` lists them).
"""

from dlrm.app.cli import console_main

if __name__ == "__main__":
    console_main()
