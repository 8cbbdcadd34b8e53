S=eval/studies/hopper_switch_ab.py
python3 $S --set CAUSAL_SPLIT_FROM=0 --same-output --shapes 128:1:1024,128:1:2048,128:1:4096,64:1:1024,64:1:2048 | tail -7
python3 $S --set CAUSAL_SPLIT_FROM=0 --same-output --batch 1 --heads 64/8 --sinks --shapes 64:1:4096,128:1:4096 | tail -4
