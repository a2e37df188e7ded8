"""Groups: a rollout group's traces with their rewards and credit status."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from .. import queries
from ..deps import CreditQuery, Reader, credit_of
from ..errors import JSONBody, responses
from ..models import GroupDetail

router = APIRouter(tags=["groups"], default_response_class=JSONBody)


@router.get("/groups/{group_id}", response_model=GroupDetail, responses=responses(404, 422))
def get_group(db: Reader, group_id: Annotated[str, Path(max_length=500)], credit: CreditQuery = None) -> Any:
    """Members, rewards (mean, std, zero variance: no group-relative gradient) and credit per trace."""
    name, label = credit_of(db, credit)
    return JSONBody({**queries.group(db, group_id, name), "credit": label})
