{{/*
Names, in the `helm create` scaffold's way. Objects in the release namespace are named from
`dsv4-operator.fullname`; objects every release shares a scope with (cluster-scoped ones, and the
Roles in watched namespaces) from `dsv4-operator.clusterName`, which adds the release namespace, so
two releases never collide even when they have the same name.
*/}}
{{- define "dsv4-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dsv4-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* fullname-releaseNamespace: unique per release across the cluster (RBAC names are not length-limited). */}}
{{- define "dsv4-operator.clusterName" -}}
{{- printf "%s-%s" (include "dsv4-operator.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "dsv4-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dsv4-operator.labels" -}}
helm.sh/chart: {{ include "dsv4-operator.chart" . }}
{{ include "dsv4-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "dsv4-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsv4-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dsv4-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dsv4-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dsv4-operator.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The Service the API server dials for admission; its DNS name is the certificate's SAN.
Service names are DNS labels (63): the fullname is cut to 55 so that the suffixes stay distinct. */}}
{{- define "dsv4-operator.webhookService" -}}
{{- printf "%s-webhook" (include "dsv4-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "dsv4-operator.metricsService" -}}
{{- printf "%s-metrics" (include "dsv4-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "dsv4-operator.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "dsv4-operator.fullname" .)) .Values.webhook.secretName }}
{{- end }}

{{/* The ValidatingWebhookConfiguration the operator creates and keeps (kopf's managed configuration):
cluster-scoped, so per release; a DNS subdomain, hence dots between fullname and namespace. */}}
{{- define "dsv4-operator.webhookConfiguration" -}}
{{- default (printf "%s.%s.validate.dsv4.ai" (include "dsv4-operator.fullname" .) .Release.Namespace) .Values.webhook.configurationName }}
{{- end }}

{{- define "dsv4-operator.leaseName" -}}
{{- default (include "dsv4-operator.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* The ServiceMonitor value as a map; `metrics.serviceMonitor: true|false` (chart 0.1.0) still works. */}}
{{- define "dsv4-operator.serviceMonitor" -}}
{{- $sm := .Values.metrics.serviceMonitor }}
{{- if kindIs "bool" $sm }}
{{- toYaml (dict "enabled" $sm) }}
{{- else }}
{{- toYaml $sm }}
{{- end }}
{{- end }}

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
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]                   # spec.monitoring.podMonitor (a 404 where its CRD is absent)
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]                          # read for status; also what the router Role grants
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/* What this release serves, recorded on its ClusterRole FULLNAME-NS-cluster for the next release to
read: the watched namespaces, comma-separated, or "*" for every namespace. */}}
{{- define "dsv4-operator.watchClaim" -}}
{{- if .Values.watchNamespaces }}{{ join "," .Values.watchNamespaces }}{{ else }}*{{ end }}
{{- end }}

{{/* Two releases serving one namespace would both reconcile its resources (each undoing the other's
writes when their versions differ) and both judge them: install and upgrade fail instead, naming the
other release. `lookup` reads the cluster during install/upgrade only; `helm template` (and GitOps
tools that render with it) skips the check. */}}
{{- define "dsv4-operator.refuseOverlap" -}}
{{- $mine := .Values.watchNamespaces }}
{{- range (lookup "rbac.authorization.k8s.io/v1" "ClusterRole" "" "").items }}
{{- $ann := .metadata.annotations | default dict }}
{{- if hasKey $ann "dsv4.ai/watch-namespaces" }}
{{- $name := get $ann "meta.helm.sh/release-name" }}
{{- $ns := get $ann "meta.helm.sh/release-namespace" }}
{{- if not (and (eq $name $.Release.Name) (eq $ns $.Release.Namespace)) }}
{{- $theirs := get $ann "dsv4.ai/watch-namespaces" }}
{{- $shared := list }}
{{- if eq $theirs "*" }}
{{- $shared = list "every namespace" }}
{{- else if not $mine }}
{{- $shared = splitList "," $theirs }}
{{- else }}
{{- range $mine }}{{ if has . (splitList "," $theirs) }}{{ $shared = append $shared . }}{{ end }}{{ end }}
{{- end }}
{{- if $shared }}
{{- fail (printf "release %s/%s of dsv4-operator already serves %s (its watchNamespaces: %s); the watchNamespaces of two releases must not overlap, and a release with empty watchNamespaces serves every namespace (docs/operator.md, \"Two releases side by side\")" $ns $name (join ", " $shared) (ternary "empty, every namespace" $theirs (eq $theirs "*"))) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
