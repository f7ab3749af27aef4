{{- define "dsv4-operator.name" -}}dsv4-operator{{- end -}}

{{- define "dsv4-operator.labels" -}}
app.kubernetes.io/name: dsv4-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dsv4-operator.selector" -}}
app.kubernetes.io/name: dsv4-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsv4-operator.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* What the operator does to a Dsv4Deployment's children, in a watched namespace. */}}
{{- define "dsv4-operator.workloadRules" -}}
- apiGroups: [dsv4.ai]
  resources: [dsv4deployments]
  verbs: [get, list, watch, patch]           # patch: kopf's finalizer
- apiGroups: [dsv4.ai]
  resources: [dsv4deployments/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, delete]   # create+patch: server-side apply
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]                          # read for status; also what the router Role grants
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
