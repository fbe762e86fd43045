"""ipdp: differentially private model training by input perturbation, streamed through Kafka.

``from ipdp import load_model`` is the one name exported here; it is imported on first use, so
``import ipdp`` (which every command and role pays for) loads nothing else.
"""

# Not typing.TYPE_CHECKING: importing typing is a cost this module does not need to pay; type
# checkers treat any constant of that name the same way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipdp.model import load_model

__all__ = ["load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from ipdp.model import load_model

        return load_model
    raise AttributeError(f"module 'ipdp' has no attribute {name!r}")
