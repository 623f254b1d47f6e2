"""What the critic leaves on disk, written so that a failure leaves nothing half-written.

Atomic directories (atomic_dir: staging, commit by rename, the writability checks) and the engines'
checkpoint layout (checkpoints: the all-ranks-or-none commit, the fingerprint, the disk-full
policy). It may import common.parallel and common.learning.
"""
