# Quick start on a CPU: a small Full AttnRes model on web text, 7–10 minutes on one core.
# $ python data/fineweb_edu/prepare.py --sample   (train.py also does it when data/fineweb_edu is empty)
# $ python train.py config/cpu_attnres.py
# Expect the validation loss to fall from ~10.8 (= ln 50280, uniform) to below 8.
out_dir = 'out/cpu_attnres'
dataset = 'fineweb_edu'
residual = 'attnres'
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 300
eval_interval = 100
eval_iters = 20
log_interval = 10
device = 'cpu'
compile = False
