"""The MoBA TPU kernels' scalar-memory figures for the layers above ops (the dry run): SMEM per
TPU generation, the kernels' table budget, and their calls' tables per chip from the shapes."""

from pallas_kernels.moba.smem_plan import CallTables as CallTables
from pallas_kernels.moba.smem_plan import moba_call_tables as moba_call_tables
from pallas_kernels.moba.tpu_smem import SMEM_BUDGET_BYTES as SMEM_BUDGET_BYTES
from pallas_kernels.moba.tpu_smem import SMEM_BYTES as SMEM_BYTES
